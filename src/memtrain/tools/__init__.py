"""Commands around runs: plan, ac-profile, prepare-data, explain-config, export, sweep, report, Slurm, bench."""
