"""The phases of rank 0's start-up from run.sh's records (seconds from the command's start)."""
import sys, glob, os, statistics
def phases(d):
    t0 = float(open(os.path.join(d, "t0")).read())
    marks, starts = {}, {}
    for f in glob.glob(os.path.join(d, "probe", "*.txt")):
        lines = [l for l in open(f).read().split("\n") if l.strip()]
        head = lines[0]
        st = float(head.split()[1]) - t0
        m = {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) - t0 for l in lines[1:] if not l.startswith("cpu:")}
        m.update({l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in lines[1:] if l.startswith("cpu:")})
        if "memtrain.train.launch" in head or "--quiet --num_gpus" in head: starts["launcher"] = st
        elif "src/train.py" in head and head.endswith("rank 0"): starts["rank0"] = st; marks = m
        elif "world_info" in head: starts["dslaunch"] = st
    r = {}
    r["preflight (process, imports + checks)"] = starts["launcher"]
    r["launcher to ranks' start"] = starts["rank0"] - starts["launcher"]
    r["rank imports (torch, transformers, memtrain)"] = marks["check_run.begin"] - starts["rank0"]
    r["rank checks (the preflight again, incl. DeepSpeed import)"] = marks["check_run.end"] - marks["check_run.begin"]
    r["data, rendezvous, plan lines"] = marks["build_engine.begin"] - marks["check_run.end"]
    r["model and DeepSpeed engine"] = marks["build_engine.end"] - marks["build_engine.begin"]
    r["first step"] = marks["first_engine_step.end"] - marks["build_engine.end"]
    r["total to the end of step 1"] = marks["first_engine_step.end"]
    if "cpu:check_run.begin" in marks:  # rank 0's own CPU seconds (user + sys), from its start
        r["rank 0 CPU: imports"] = marks["cpu:check_run.begin"]
        r["rank 0 CPU: to the end of step 1"] = marks["cpu:first_engine_step.end"]
    return r
# phases.py BEFORE_DIR,... AFTER_DIR,...: a table of each phase, one column per set of runs
runs = {k: [phases(d) for d in dirs.split(",")] for k, dirs in zip(("old", "new"), sys.argv[1:3])}
keys = list(runs["old"][0])
print("| phase | before | after |")
print("|---|---|---|")
for k in keys:
    cells = []
    for which in ("old", "new"):
        vals = [r[k] for r in runs[which]]
        cells.append(" / ".join(f"{v:.1f}" for v in vals))
    print(f"| {k} | {cells[0]} | {cells[1]} |")
