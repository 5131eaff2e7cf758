"""Move flat tests/test_*.py files into the two test tiers (#39 item 5): tests/unit/<package>/ runs in process,
tests/launch/ starts the launcher or a subprocess run.

    python tests/tiers_move.py                     # every flat tests/test_*.py
    python tests/tiers_move.py tests/test_cli.py   # one file, e.g. a branch's version left flat by a merge

A file of WHOLE moves as it is. A file of SPLIT is cut by test: each test goes where the table puts it;
a test the table does not know goes to launch/ when it (or a helper it uses) starts a process (LAUNCHES), else to
the file's unit/ destination. Each part keeps the module docstring, the imports its code uses (ruff drops the
rest), the module-level statements, and the helpers its tests use; test bodies are unchanged. SHARED helpers, used
from both tiers, live in conftest.py or chatml.py: their definitions are dropped and the imports point there.
Re-running on an already moved tree does nothing (no flat test files are left)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SHARED = {"_workers": "conftest", "TEMPLATE": "chatml"}
EVERY_PART = {"pytestmark"}
LAUNCHES = re.compile(r"\b(run_train|run_launch|launch_cmd|Launch|subprocess|Popen|_workers|_worker\.py)\b")

WHOLE = {
    'test_cadence.py': 'launch/test_cadence.py',
    'test_chat_formats.py': 'unit/model/test_chat_formats.py',
    'test_compile.py': 'unit/recompute/test_compile.py',
    'test_final_weights.py': 'launch/test_final_weights.py',
    'test_families.py': 'unit/model/test_families.py',
    'test_flops.py': 'unit/memory/test_flops.py',
    'test_freeze.py': 'unit/model/test_freeze.py',
    'test_gpu.py': 'launch/test_gpu.py',
    'test_launcher.py': 'launch/test_launcher.py',
    'test_layering.py': 'unit/test_layering.py',
    'test_model.py': 'unit/model/test_model.py',
    'test_multinode.py': 'launch/test_multinode.py',
    'test_plan_search.py': 'unit/memory/test_plan_search.py',
    'test_recompute_spec.py': 'unit/config/test_recompute_spec.py',
    'test_sbatch_env.py': 'launch/test_sbatch_env.py',
    'test_slurm.py': 'launch/test_slurm.py',
}

SPLIT = {
    'test_ac_policies.py': {
        'launch/test_ac_policies.py': [
            'test_policies_under_zero3_match_no_recompute',
        ],
        'unit/recompute/test_ac_policies.py': [
            'test_every_policy_matches_no_recompute',
            'test_activation_ordering_recompute_cost_and_full_matches_analytic',
            'test_policy_strings_and_compositions',
            'test_op_needs_torch_backend_and_bad_keys_are_user_errors',
            'test_stateful_modules_warn_and_overlapping_patterns_are_skipped',
            'test_ac_profile_cli_writes_table_and_csv',
            'test_op_default_does_not_keep_the_last_matmul',
        ],
    },
    'test_bad_input.py': {
        'launch/test_bad_input.py': [
            'test_one_line_no_traceback_no_worker',
            'test_make_passes_budget_as_one_argument',
            'test_a_world_size_left_in_the_environment_trains_one_process',
        ],
        'unit/train/test_bad_input.py': [
            'test_bad_recipe_or_override',
            'test_bad_deepspeed_json',
            'test_malformed_files',
            'test_data_without_usable_text',
            'test_op_policy_with_reentrant_backend',
            'test_run_directory_rules',
            'test_legal_but_useless_settings_warn',
            'test_round_two_mistakes',
            'test_non_utf8_deepspeed_json',
            'test_tool_flags_one_line',
        ],
    },
    'test_chat_data.py': {
        'launch/test_chat_data.py': [
            'test_trainer_trains_on_chat_rows_and_counts_real_tokens',
        ],
        'unit/model/test_chat_data.py': [
            'test_labels_are_the_assistants_tokens_and_the_loss_is_theirs',
            'test_packed_samples_do_not_attend_to_each_other',
            'test_bad_rows_are_counted_in_one_line_and_formats_are_checked',
        ],
    },
    'test_cli.py': {
        'launch/test_cli.py': [
            'test_front_door_lists_every_command',
            'test_help_imports_no_torch',
            'test_make_variables_with_spaces_stay_one_argument',
            'test_quick_exit_does_what_an_exit_does_but_the_teardown',
        ],
        'unit/tools/test_cli.py': [
            'test_each_command_has_its_help',
            'test_each_command_names_itself_in_errors',
            'test_makefile_targets_use_the_front_door',
            'test_export_mistakes_are_one_line',
        ],
    },
    'test_cluster.py': {
        'launch/test_cluster.py': [
            'test_packing_longer_than_the_collective_timeout_kills_no_rank',
            'test_host_memory_is_checked_against_the_nodes_ranks_and_the_cgroup',
            'test_a_node_check_failed_on_rank_1_alone_is_printed_by_rank_1',
            'test_host_memory_counts_every_agents_ranks_on_the_node',
            'test_gloo_gets_its_descriptors_and_an_address_other_nodes_reach',
            'test_a_frozen_rank_ends_the_others_within_the_collective_timeout',
        ],
        'unit/train/test_cluster.py': [
            'test_cpu_threads_split_the_ranks_cores_where_cpu_work_runs',
            'test_node_errors_print_once_per_node_and_launch',
            'test_a_data_path_this_node_cannot_see_is_a_node_error',
        ],
    },
    'test_ds_corpus.py': {
        'launch/test_ds_corpus.py': [
            'test_own_optimizer_matches_deepspeeds',
            'test_runs_are_quiet_and_recorded',
            'test_final_and_export_load_with_transformers',
        ],
        'unit/config/test_ds_corpus.py': [
            'test_corpus_is_complete',
            'test_preflight_decides_each_json',
            'test_no_warmup_trains_at_the_full_learning_rate_from_step_1',
            'test_auto_fills_follow_transformers',
            'test_number_checkpoints_counts_checkpoint_calls',
            'test_stale_build_lock_is_cleared_live_one_kept',
            'test_on_a_shared_filesystem_a_lock_is_stale_only_when_its_folder_is_quiet',
            'test_explain_config_says_what_each_key_does',
            'test_skipped_steps_warning_threshold',
        ],
    },
    'test_faults.py': {
        'launch/test_faults.py': [
            'test_kill_during_save_then_resume_from_previous_good_checkpoint',
            'test_nan_loss_stops_with_step_last_good_checkpoint_and_hint',
            'test_nonfinite_weights_are_never_saved',
            'test_out_of_memory_advice_uses_the_limit_that_binds',
            'test_a_full_disk_is_one_line_and_loses_nothing',
            'test_stop_deadline_warns_once_when_stopping_would_outlast_it',
        ],
        'unit/train/test_faults.py': [
            'test_out_of_memory_report',
        ],
    },
    'test_long_context.py': {
        'launch/test_long_context.py': [
            'test_two_ranks_zero_stages_sequence_parallel_fused_tiled',
        ],
        'unit/model/test_long_context.py': [
            'test_fused_loss_equals_hf_standard',
            'test_fused_loss_peak_at_8k_vocab_is_under_an_eighth',
            'test_chunked_linear_cross_entropy_equals_reference',
            'test_tiled_mlp_same_gradients_lower_peak',
            'test_tiled_mlp_auto_shards',
            'test_sequence_parallel_rejections',
            'test_sequence_parallel_refuses_what_ulysses_gets_wrong',
            'test_sequence_parallel_refuses_hybrid_layers',
            'test_sequence_parallel_rejects_zero0_and_json_mismatch',
            'test_planner_logits_term_standard_and_fused_match_the_allocator',
            'test_planner_counts_the_mask_of_packed_rows',
            'test_planner_tiled_mlp_working_set_matches_the_allocator',
            'test_planner_host_memory_of_offloaded_inputs_and_sequence_parallel_tokens',
            'test_plan_max_seq',
            'test_plan_max_seq_stops_at_the_models_positions',
        ],
    },
    'test_lora.py': {
        'launch/test_lora.py': [
            'test_final_holds_the_merged_model_and_the_adapter_that_reproduces_it',
            'test_final_generates_with_the_kv_cache_and_stops_at_the_end_of_turn',
            'test_a_stopped_lora_run_resumes_to_the_straight_runs_losses',
        ],
        'unit/model/test_lora.py': [
            'test_adapters_on_a_module_the_model_lacks_are_one_line',
            'test_planner_lora_run_keeps_states_for_the_adapters_only',
            'test_what_trains_beside_the_adapters_goes_into_the_adapter_or_is_one_line',
            'test_dora_under_zero3_and_a_trainable_adapted_weight_are_one_line_before_any_worker',
            'test_a_trained_tied_lm_head_goes_into_the_adapter_with_the_embedding',
        ],
    },
    'test_offload.py': {
        'launch/test_offload.py': [
            'test_zero3_two_ranks_with_cpu_checkpointing',
            'test_bench_runs_the_trainer_with_offload',
            'test_a_hung_set_up_is_killed_with_its_children_after_the_timeout',
            'test_sigterm_to_the_bench_kills_the_set_up_it_is_running',
            'test_a_killed_bench_takes_its_set_up_along',
            'test_bench_host_counts_zero3_work_beside_plain_pytorch',
        ],
        'unit/recompute/test_offload.py': [
            'test_grads_equal_pool_reused_memory_moves_to_host',
            'test_compiled_layers_offload_their_inputs_and_nothing_else',
            'test_offloaded_tensors_come_back_bit_exact',
            'test_graph_dropped_without_backward_returns_buffers',
            'test_pool_best_fit',
            'test_plan_flags_and_description',
            'test_sqrt_offloads_every_segment_head_but_the_last',
            'test_mlp_units_offload_all_but_the_last',
            'test_pool_steady_state_allocates_nothing_and_shrinks_with_the_shapes',
            'test_pool_drops_unused_buffers_and_caps_cached_bytes_at_the_step_peak',
        ],
        'unit/tools/test_bench.py': [
            'test_bench_setup_names_with_zero3_flags',
            'test_bench_setups_search_and_table',
            'test_gpu_check_writes_after_each_set_up_and_stops_when_the_trainer_is_broken',
            'test_gpu_check_resume_keeps_what_measured_and_runs_failures_again',
            'test_bench_flag_mistakes_are_one_line',
            'test_bench_host_shows_the_median_round_and_the_range',
            'test_bench_host_legend_clears_the_axis_label',
        ],
    },
    'test_planner.py': {
        'launch/test_planner.py': [
            'test_model_states_match_deepspeed_per_term',
            'test_auto_trains_default_recipe_with_a_mixed_plan',
        ],
        'unit/memory/test_planner.py': [
            'test_activation_bytes_match_ac_profile_default_recipe',
            'test_activation_bytes_match_1b_layer_shape',
            'test_activation_peak_matches_a_real_step',
            'test_dp_is_exact_and_beats_uniform_policies',
            'test_dp_with_offload_keeps_its_plans_within_the_limit',
            'test_nothing_fits_says_what_would',
            'test_plan_cli_every_recipe',
            'test_plan_cli_budget_table',
            'test_predict_run_matches_the_allocator',
            'test_predict_run_says_what_it_cannot_model',
            'test_offload_prefetch_term_matches_restores_on_cpu',
            'test_zero12_reduce_buffers_count_in_the_backward_only',
            'test_a_layer_without_an_mlp_sublayer_plans_every_other_policy',
            'test_predict_run_of_a_lora_run_matches_the_allocator',
        ],
    },
    'test_pretrained_inputs.py': {
        'launch/test_pretrained_inputs.py': [
            'test_a_run_trains_on_the_pretrained_tokenizers_ids',
        ],
        'unit/model/test_pretrained_inputs.py': [
            'test_truncated_safetensors_is_one_line',
            'test_sharded_checkpoint_missing_or_truncated_shard',
            'test_pytorch_model_bin_truncated',
            'test_config_without_weights',
            'test_model_config_override_that_disagrees_with_the_checkpoint',
            'test_override_that_resizes_fused_experts',
            'test_pretrained_tokenizer_is_the_default',
            'test_tokenizer_larger_than_the_embeddings',
        ],
    },
    'test_recipe.py': {
        'launch/test_recipe.py': [
            'test_bad_recipe_key_is_one_line_without_traceback',
            'test_error_found_after_deepspeed_import_is_still_one_line',
        ],
        'unit/config/test_recipe.py': [
            'test_default_recipe_and_overrides',
            'test_bad_override_names_the_key',
        ],
    },
    'test_reshard.py': {
        'launch/test_reshard.py': [
            'test_a_run_resumes_on_another_world_size_as_a_straight_run',
        ],
        'unit/train/test_reshard.py': [
            'test_a_resume_on_another_batch_continues_at_the_samples_read',
        ],
    },
    'test_resume.py': {
        'launch/test_resume.py': [
            'test_stopped_and_resumed_equals_uninterrupted',
            'test_stop_signal_on_one_rank_stops_all_within_two_steps_and_a_last_step_stop_resumes_to_completed',
            'test_sigterm_to_the_launcher_alone_stops_every_rank_within_two_steps',
            'test_make_trains_launch_stops_cleanly',
            'test_stop_signal_during_start_up_ends_preempted_and_the_requeue_starts_cleanly',
            'test_tensor_parallel_run_resumes_exactly',
            'test_timed_saves_are_agreed_on_every_rank_and_on_by_default_in_a_slurm_job',
        ],
        'unit/train/test_resume.py': [
            'test_a_timed_save_is_asked_for_once',
        ],
    },
    'test_run_dir_safety.py': {
        'launch/test_run_dir_safety.py': [
            'test_overwrite_with_a_mistake_changes_nothing',
            'test_overwrite_that_fails_or_is_killed_before_its_first_checkpoint',
            'test_resume_refuses_or_falls_back_on_each_damaged_file',
            'test_resume_past_damaged_checkpoints_equals_the_run',
            'test_a_run_stopped_on_its_last_step_without_a_summary_resumes_to_completion',
            'test_resume_continues_with_the_runs_saved_inputs',
            'test_a_run_directory_in_use_by_another_run_is_refused',
            'test_rank_0_decides_the_resume_point_and_what_follows_from_it',
        ],
        'unit/train/test_run_dir_safety.py': [
            'test_a_requeued_slurm_job_goes_on_past_its_own_stale_lock',
        ],
    },
    'test_sweep_report.py': {
        'launch/test_sweep_report.py': [
            'test_report_of_a_sweep_that_never_ran_is_one_line',
            'test_two_point_sweep_end_to_end_with_one_failure',
        ],
        'unit/tools/test_sweep_report.py': [
            'test_medians_are_over_steps_after_warmup_and_final_loss_is_last',
            'test_report_rows_pareto_failures_and_budget',
            'test_budget_parsing_and_sweep_file_errors',
            'test_point_ids_args_and_resumability',
            'test_failure_reason_picks_the_telling_line',
            'test_shipped_sweep_files_expand',
            'test_a_sweep_never_deletes_a_finished_run',
            'test_slurm_sweeps_on_gpu_nodes_ask_for_their_cpu_share',
            'test_a_sweep_shrinks_from_the_command_line',
            'test_throughput_plot_starts_at_zero_and_says_the_spread',
        ],
    },
    'test_tensor_parallel.py': {
        'launch/test_tensor_parallel.py': [
            'test_zero3_model_gets_transformers_init',
            'test_tp2_matches_tp1',
            'test_partition_halves_checkpointed_bytes_with_identical_grads',
            'test_planner_divides_what_tp_shards',
            'test_configure_needs_initialize_first',
            'test_output_hidden_states_survive_partitioning',
            'test_trainer_counts_each_token_once',
            'test_parallel_groups_wait_no_longer_than_the_world',
            'test_tp_final_model_is_whole_and_trained',
            'test_bad_autotp_size_subprocess',
            'test_every_family_autotp_takes_trains_as_tp1',
        ],
        'unit/train/test_tensor_parallel.py': [
            'test_bad_autotp_size_is_one_line',
            'test_tensor_parallel_groups_across_nodes_warn',
            'test_unsharded_model_is_one_line',
        ],
    },
    'test_token_loss.py': {
        'launch/test_token_loss.py': [
            'test_first_step_gradients_are_the_token_mean_whatever_the_batch_layout',
        ],
        'unit/model/test_token_loss.py': [
            'test_every_rank_counts_the_steps_labelled_tokens_from_the_data',
        ],
    },
    'test_token_store.py': {
        'launch/test_token_store.py': [
            'test_an_interrupted_build_is_never_read_and_the_rebuild_is_identical_with_any_worker_count',
            'test_a_corpus_larger_than_the_memory_left_to_the_build_builds',
            'test_a_run_builds_its_store_with_worker_processes_and_trains_on_the_split',
        ],
        'unit/model/test_token_store.py': [
            'test_default_corpus_batches_equal_todays_packing_and_a_new_seq_len_tokenizes_nothing',
            'test_eval_split_holds_no_training_document_and_bad_splits_are_one_line',
            'test_a_file_unreadable_in_the_middle_of_a_build_is_one_line',
            'test_a_blend_keeps_each_sources_share_in_every_prefix_and_its_mistakes_are_one_line',
            'test_processes_asking_at_once_build_a_store_once_and_a_mount_without_locks_still_builds_it',
            'test_a_local_fast_tokenizer_encodes_as_transformers_does',
        ],
    },
    'test_tp_dropout.py': {
        'launch/test_tp_dropout.py': [
            'test_tp_group_draws_one_models_residual_masks',
            'test_sharded_heads_draw_their_own_masks_and_the_residual_stream_stays_one',
            'test_recompute_replays_the_sharded_masks',
            'test_trainer_ranks_agree_at_every_step_and_after_resume',
        ],
        'unit/train/test_tp_dropout.py': [
            'test_dropout_autotp_cannot_place_is_one_line',
        ],
    },
    'test_local_launch.py': {
        'launch/test_local_launch.py': [
            'test_ranks_get_what_deepspeeds_launch_gives_them',
            'test_a_failing_rank_ends_the_others_with_its_exit_code',
        ],
        'unit/train/test_local_launch.py': [
            'test_only_make_trains_line_is_taken',
            'test_a_gpu_a_hostfile_or_a_device_list_goes_through_deepspeeds_runner',
        ],
    },
    'test_qlora.py': {
        'launch/test_qlora.py': [
            'test_a_zero3_run_writes_an_adapter_for_the_unquantized_base_and_resumes',
        ],
        'unit/model/test_qlora.py': [
            'test_adapter_gradients_equal_a_plain_peft_and_bitsandbytes_model',
            'test_planner_counts_the_4bit_base_within_1_percent',
            'test_what_a_4bit_base_cannot_run_with_is_one_line',
            'test_gpu_check_runs_lora_beside_qlora',
            'test_plan_search_keeps_to_what_a_4bit_base_runs_with',
        ],
    },
    'test_zero3_hooks.py': {
        'launch/test_zero3_hooks.py': [
            'test_leaf_layers_recompute_without_fetching',
            'test_hooked_submodules_fetch_again_in_recompute',
            'test_per_step_state_stays_flat',
            'test_hooked_layers_get_deepspeeds_reentrant_checkpoint',
            'test_gradients_equal_hooked_run_and_no_recompute',
            'test_compiled_layers_train_as_eager_ones_and_compile_only_in_the_warm_up',
            'test_offloaded_recompute_under_zero3_equals_no_recompute',
            'test_composed_policies_and_deepspeed_sublayers_equal_no_recompute',
            'test_frozen_weights_stay_put_and_the_rest_get_the_full_runs_gradients',
            'test_lora_gradients_equal_a_plain_peft_models',
            'test_zero3_build_gets_the_models_own_init',
            'test_every_family_trains_under_zero3',
            'test_multi_head_families_under_sequence_parallel',
        ],
        'unit/config/test_zero3_layout.py': [
            'test_layout_makes_layers_leaf_modules_unless_the_json_decides',
            'test_layout_keeps_parameters_resident_only_where_nothing_is_sharded',
        ],
    },
}


def top_level_chunks(source: str) -> list[tuple[ast.stmt, str]]:
    """Each top-level statement with its source text, the comments and blank lines above it included."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    chunks, start = [], 0
    for node in tree.body:
        end = node.end_lineno
        chunks.append((node, "".join(lines[start:end])))
        start = end
    if start < len(lines) and chunks:
        node, text = chunks[-1]
        chunks[-1] = (node, text + "".join(lines[start:]))
    return chunks


def defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def used(node: ast.stmt) -> set[str]:
    """Names a statement reads, its arguments included (pytest fixtures are asked for by argument name)."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names |= {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    return names


def is_test(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
        node.name.lower().startswith("test")


def destinations(name: str, chunks: list) -> dict[str, str]:
    """Each test of a flat file -> its path under tests/."""
    if name in WHOLE:
        return {n.name: WHOLE[name] for n, _ in chunks if is_test(n)}
    if name not in SPLIT:
        sys.exit(f"tiers_move: {name}: not in WHOLE or SPLIT; add it to the table")
    table = {test: dest for dest, tests in SPLIT[name].items() for test in tests}
    unit = next(d for d in SPLIT[name] if d.startswith("unit/"))
    launch = next(d for d in SPLIT[name] if d.startswith("launch/"))
    helpers = {d: text for n, text in chunks if not is_test(n) for d in defined(n)}
    out = {}
    for node, text in chunks:
        if is_test(node):
            if node.name not in table:
                reach = text + "".join(helpers.get(u, "") for u in used(node))
                table[node.name] = launch if LAUNCHES.search(reach) else unit
                print(f"tiers_move: {name}::{node.name} is not in the table: {table[node.name]}")
            out[node.name] = table[node.name]
    return out


def needed(tests: list[ast.stmt], chunks: list) -> set[int]:
    """Indices of the helper chunks the given tests reach, directly or through other helpers."""
    by_name = {d: i for i, (n, _) in enumerate(chunks) if not is_test(n) for d in defined(n)}
    todo, seen = [u for t in tests for u in used(t)], set()
    while todo:
        i = by_name.get(todo.pop())
        if i is not None and i not in seen:
            seen.add(i)
            todo.extend(used(chunks[i][0]))
    return seen


def fix_text(text: str, dest: str) -> str:
    """Paths from __file__ one or two folders deeper; SHARED helpers imported from where they now live."""
    depth = dest.count("/") + 1
    text = text.replace("Path(__file__).resolve().parents[1]", f"Path(__file__).resolve().parents[{depth}]")
    for helper, module in SHARED.items():
        text = re.sub(rf"from test_\w+ import {helper}\b", f"from {module} import {helper}", text)
    return text


def import_shared(keep: list[str]) -> list[str]:
    """An import line, after the last top-level import, for each SHARED helper the part uses without importing it."""
    text = "".join(keep)
    missing = [name for name in SHARED if re.search(rf"\b{name}\b", text)
               and not re.search(rf"^\s*from \w+ import .*\b{name}\b", text, re.M)]
    if not missing:
        return keep
    last = max(i for i, t in enumerate(keep) if re.match(r"(from|import) ", t.strip().splitlines()[-1]))
    lines = "".join(f"from {SHARED[name]} import {name}\n" for name in missing)
    return keep[:last + 1] + [lines] + keep[last + 1:]


def split(path: Path) -> list[Path]:
    source = path.read_text()
    chunks = top_level_chunks(source)
    dest_of = destinations(path.name, chunks)
    parts: dict[str, list[int]] = {}
    for i, (node, _) in enumerate(chunks):
        if is_test(node):
            parts.setdefault(dest_of[node.name], []).append(i)
    users: dict[int, list[str]] = {}
    for dest, idx in parts.items():
        for i in needed([chunks[j][0] for j in idx], chunks):
            users.setdefault(i, []).append(dest)
    if not parts:
        sys.exit(f"tiers_move: {path.name}: no test in it; move it by hand")
    home = next((d for d in parts if d.startswith("unit/")), max(parts, key=lambda d: len(parts[d])))
    written = []
    for dest, idx in parts.items():
        keep = []
        for i, (node, text) in enumerate(chunks):
            names = defined(node)
            if is_test(node):
                take = i in idx
            elif names & set(SHARED):
                take = False
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not names & EVERY_PART:
                take = dest in users.get(i, [home])  # a helper: in each part that uses it
            else:  # docstring, imports, sys.path and pytestmark lines: every part
                take = True
            if take:
                keep.append(text)
        keep = import_shared(keep)
        target = TESTS / dest
        for folder in [target.parent, *target.parent.parents]:
            if folder == TESTS:
                break
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
            written.append(folder / "__init__.py")
        target.write_text(re.sub(r"\n{3,}(?=\S)", "\n\n\n", fix_text("".join(keep), dest)).rstrip("\n") + "\n")
        written.append(target)
    return written


def main(argv: list[str]) -> None:
    paths = [Path(a).resolve() for a in argv] or sorted(TESTS.glob("test_*.py"))
    written = []
    for path in paths:
        written += split(path)
        subprocess.run(["git", "rm", "-q", "--cached", "--ignore-unmatch", str(path)], cwd=TESTS, check=True)
        path.unlink()
    if written:
        tests = sorted({str(p) for p in written if p.name != "__init__.py"})
        subprocess.run([sys.executable, "-m", "ruff", "check", "-q", "--fix", "--select", "F401", *tests],
                       cwd=TESTS.parent)
        subprocess.run(["git", "add", *sorted({str(p) for p in written})], cwd=TESTS, check=True)
        print(f"tiers_move: {len(paths)} file(s) -> {len(tests)} file(s)")


if __name__ == "__main__":
    main(sys.argv[1:])
