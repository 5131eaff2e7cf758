"""Commands around runs: plan, ac-profile, sweep, Slurm, report, bench."""
