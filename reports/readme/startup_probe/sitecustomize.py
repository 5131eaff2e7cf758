"""Start-up probe (measurement only): timestamps of a rank's phases, written to $STARTUP_PROBE_OUT/<pid>.txt."""
import builtins, os, sys, time

_out = os.environ.get("STARTUP_PROBE_OUT")
if _out:
    import functools
    _t0 = time.time()
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            _ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            _up = float(f.read().split()[0])
        _t0 = time.time() - (_up - _ticks / os.sysconf("SC_CLK_TCK"))  # the process's start
    except Exception:
        pass
    _log = open(os.path.join(_out, f"{os.getpid()}.txt"), "a", buffering=1)
    _log.write(f"start {_t0:.3f} argv {' '.join(sys.argv[:3])} rank {os.environ.get('RANK', '-')}\n")
    _log.write(f"site {time.time():.3f}\n")

    def mark(label):
        _log.write(f"{label} {time.time():.3f}\n")
        cpu = os.times()  # this process's CPU seconds so far (user + sys)
        _log.write(f"cpu:{label} {cpu.user + cpu.system:.3f}\n")
        if label == "first_engine_step.end" and os.environ.get("RANK") == "0":  # what the rank imported by then
            with open(os.path.join(_out, "modules_at_step1.list"), "w") as f:
                f.write("\n".join(sorted(sys.modules)) + "\n")

    def wrap(owner, name, label, once=True):
        fn = getattr(owner, name, None)
        if fn is None or getattr(fn, "_probed", False):
            return
        done = []

        @functools.wraps(fn)
        def probed(*a, **k):
            first = not done
            prof = None
            if first:
                mark(label + ".begin")
                if label in os.environ.get("STARTUP_PROBE_PROFILE", "").split(",") and os.environ.get("RANK") == "0":
                    import cProfile
                    prof = cProfile.Profile()
                    prof.enable()
            try:
                return fn(*a, **k)
            finally:
                if first:
                    if prof is not None:
                        prof.disable()
                        prof.dump_stats(os.path.join(_out, f"{label}.prof"))
                    mark(label + ".end")
                    done.append(1)
        probed._probed = True
        setattr(owner, name, probed)

    _import = builtins.__import__
    _seen = set()

    def _hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        mods = sys.modules
        for key in ("torch", "deepspeed", "transformers", "memtrain.train.trainer", "memtrain.train.main",
                    "memtrain.train.preflight", "datasets", "torch._inductor.compile_fx", "deepspeed.runtime.zero.muon.muon_optimizer", "torch._dynamo"):
            if key in mods and key not in _seen and getattr(mods[key], "__spec__", None) is not None \
                    and getattr(mods[key].__spec__, "_initializing", False) is False:
                _seen.add(key)
                mark(f"imported:{key}")
        tr = mods.get("memtrain.train.trainer")
        if tr is not None and (hasattr(tr, "_start") or hasattr(tr, "Trainer")) \
                and not getattr(tr, "_probe_done", False):
            tr._probe_done = True
            wrap(tr, "resolve_run", "check_run")  # the trainer's checks since the preflight's refactor
            for fn in ("check_run", "check_host_memory", "_meet", "build_model", "build_model_zero3", "prepare_data",
                       "prepare_eval_data", "apply_plan", "_build_engine", "build_engine"):
                wrap(tr, fn, fn)
        ds = mods.get("deepspeed")
        if ds is not None and hasattr(ds, "initialize"):
            wrap(ds, "initialize", "deepspeed.initialize")
        eng = getattr(mods.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
        if eng is not None:
            wrap(eng, "step", "first_engine_step")
            wrap(eng, "forward", "first_forward")
        return module

    builtins.__import__ = _hook
