"""``kmgpu launch`` with JAX: 2 hosts x 1 process on 127.0.0.1 through
``jax.distributed`` (keras.distribution.initialize).
"""

from tests.launch import nodes


def test_two_hosts_match_one_process_and_stop_when_one_dies(tmp_path):
    run = nodes.parity_then_kill("jax", str(tmp_path))
    assert run["seconds_to_fail"] < 60
    assert "jax.distributed" in run["results"][0]["engine"]
