"""The policy string is parsed in one place (memtrain.config.ac_policy): every way in gives the same value and the
same one-line message, and no other module of src/ splits a policy string."""
import re

import pytest

from conftest import ROOT
from memtrain.config.ac_policy import Policy, parse_policy
from memtrain.config.recipe import ACSection, load_recipe
from memtrain.errors import UserError
from memtrain.recompute.policy import plan_for

ALLOWED = ("; allowed: none | full | every:K | first:N | sqrt | selective:attn | selective:mlp | op | modules | auto "
           "(per layer, under activation_checkpointing.memory_budget); full, sqrt, op and selective:* also take "
           "+first:N, and all but sqrt +every:K (e.g. op+first:4)")
BAD = {"sometimes": "unknown policy",
       "every:x": "expected a positive integer after ':', got 'x'",
       "op+first:0": "expected a positive integer after ':', got '0'",
       "none+first:2": "'none' takes no layer selector",
       "sqrt+every:2": "sqrt segments are runs of consecutive layers; it composes with +first:N only",
       "full+last:2": "unknown layer selector 'last:2'",
       "auto+first:1": "unknown policy"}


def _message(call) -> str:
    with pytest.raises(UserError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("bad", BAD)
def test_bad_policy_same_line_every_way_in(tmp_path, bad):
    line = f"activation_checkpointing.policy: '{bad}': {BAD[bad]}{ALLOWED}"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"activation_checkpointing:\n  policy: '{bad}'\n")
    assert _message(lambda: load_recipe(str(recipe))) == f"{recipe}: {line}"
    assert _message(lambda: load_recipe(None, [f"activation_checkpointing.policy={bad}"])) == \
        f"recipe 'tiny' (embedded default) with --set: {line}"
    assert _message(lambda: plan_for(bad, 4)) == line
    assert _message(lambda: parse_policy(bad)) == line
    with pytest.raises(ValueError, match=re.escape(line.partition(": ")[2])):
        ACSection(policy="full").policy = bad  # assignment validates too (memory.plan_files sets policy auto)


@pytest.mark.parametrize("text, base, selector, count, modes", [
    ("full", "full", None, None, "RRRRR"),
    ("every:2", "full", "every", 2, "R.R.R"),
    ("first:2", "full", "first", 2, "RR..."),
    ("op+first:4", "op", "first", 4, "OOOO."),
    ("selective:attn+every:3", "selective:attn", "every", 3, "A..A."),
    ("sqrt+first:4", "sqrt", "first", 4, "[R R] [R R] ."),
    ("none", "none", None, None, "....."),
    ("modules", "modules", None, None, "....."),
])
def test_one_parsed_value_from_recipe_to_plan(text, base, selector, count, modes):
    recipe = load_recipe(None, [f"activation_checkpointing.policy={text}"])
    parsed = recipe.activation_checkpointing.policy
    assert (type(parsed), parsed.base, parsed.selector, parsed.count) == (Policy, base, selector, count)
    assert parsed == text and str(parsed) == text
    saved = recipe.model_dump()["activation_checkpointing"]["policy"]
    assert type(saved) is str and saved == text  # saved back as the text
    plan = plan_for(text, 5, modules=["model.layers.*.mlp"])
    assert plan.spec.ac_policy == parsed and plan.policy == text
    marks = plan.layer_marks().replace(" ", "") if "[" not in modes else plan.layer_marks()
    assert marks == modes


def test_no_second_parser_in_src():
    """A policy's '+' (base+selector) is split only by memtrain.config.ac_policy."""
    src = ROOT / "src" / "memtrain"
    splits = re.compile(r"""(partition|split)\(\s*["']\+["']""")
    # compile_choice splits `make gpu-check` set-up names ('op+compile'), not a policy
    others = {src / "config" / "ac_policy.py", src / "train" / "compile_choice.py"}
    found = [str(p.relative_to(src)) for p in sorted(src.rglob("*.py"))
             if splits.search(p.read_text()) and p not in others]
    assert found == [], f"a second policy parser: {found}"
    assert splits.search((src / "config" / "ac_policy.py").read_text())  # the pattern finds the one parser
