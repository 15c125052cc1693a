"""``kmgpu launch`` with TensorFlow: 2 hosts x 1 process on 127.0.0.1, one TF_CONFIG
per worker, ``tf.distribute.MultiWorkerMirroredStrategy``."""

from tests.launch import nodes


def test_two_hosts_match_one_process_and_stop_when_one_dies(tmp_path):
    run = nodes.parity_then_kill("tensorflow", str(tmp_path))
    assert run["seconds_to_fail"] < 60
    assert run["results"][0]["engine"] == "tf.distribute.MultiWorkerMirroredStrategy"
    for r in run["results"]:
        # a generator fed per replica (as are a PyDataset and a DataLoader): Keras's
        # adapters gave each worker whole batches of its own (0.70-0.96 from one
        # process); an own loss, 0 on one row, on a last batch split 2 + 1 (refused
        # before the layer ran on the global batch)
        sources = r["sources"]
        assert sources["first fit"] < 1e-5, r
        assert sources["second fit"] < 1e-5, r
