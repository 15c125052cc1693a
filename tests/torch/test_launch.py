"""``kmgpu launch`` with torch: torchrun on 2 hosts x 2 processes on 127.0.0.1 (gloo),
kmgpu's torch engine in-process on each rank."""

from tests.launch import nodes


def test_two_hosts_of_two_match_one_process_and_stop_when_one_dies(tmp_path):
    run = nodes.parity_then_kill("torch", str(tmp_path), nproc=2)
    assert run["seconds_to_fail"] < 60
    assert "in-process" in run["results"][0]["engine"]
