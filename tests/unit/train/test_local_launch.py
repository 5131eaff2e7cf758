"""make train's launcher starting CPU ranks itself (memtrain.train.local_launch): which lines and machines it takes,
the environment each rank gets (against what DeepSpeed's launch.py gives), and launch.py's rule on a failing rank."""


from memtrain.train import local_launch
from memtrain.train.local_launch import Local, parse


def test_only_make_trains_line_is_taken():
    assert parse(["--quiet", "--num_gpus", "2", "src/train.py", "--max-steps", "3"]) == \
        Local(2, 29500, "src/train.py", ("--max-steps", "3"))
    assert parse(["--num_gpus=4", "--master_port", "1234", "x.py"]) == Local(4, 1234, "x.py", ())
    for other in (["--hostfile", "h", "--num_gpus", "2", "x.py"], ["--num_gpus", "2", "--include", "localhost:0",
                  "x.py"], ["x.py"], ["--num_gpus", "0", "x.py"], ["--num_gpus", "two", "x.py"], ["--num_gpus", "2"],
                  ["--num_gpus", "2", "--num_gpus", "3", "x.py"], ["--master_port"]):
        assert parse(other) is None, other


def test_a_gpu_a_hostfile_or_a_device_list_goes_through_deepspeeds_runner(monkeypatch, tmp_path):
    monkeypatch.setattr(local_launch, "GPU_SIGNS", (str(tmp_path / "nvidia"),))
    monkeypatch.setattr(local_launch, "HOSTFILE", str(tmp_path / "hostfile"))
    assert local_launch.applies({}) and local_launch.applies({"DS_ACCELERATOR": "cpu"})
    assert not local_launch.applies({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert not local_launch.applies({"DS_ACCELERATOR": "cuda"})
    (tmp_path / "hostfile").write_text("node1 slots=8\n")
    assert not local_launch.applies({})
    (tmp_path / "hostfile").unlink()
    (tmp_path / "nvidia").mkdir()
    assert not local_launch.applies({})
