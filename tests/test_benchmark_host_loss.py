"""benchmarks/host_loss.py times a host's loss to the first step after recovery from the checkpoint the recovered
run says it continues from, said after the loss, not from a guess at it made from host 0's marks."""

from types import SimpleNamespace

from benchmarks.host_loss import continued_after


def test_the_checkpoint_a_recovered_run_continues_from_is_read_from_what_host_0_says_after_the_loss(tmp_path):
    log = tmp_path / "torchrun.log"
    log.write_text("aqpipe: /mnt/run holds this run: it continues after step 8\n")  # (an earlier restart)
    hosts = SimpleNamespace(disk=lambda host: tmp_path)
    offset = log.stat().st_size
    assert continued_after(hosts, offset) is None  # (nothing said since the loss)
    with log.open("a") as more:
        more.write("[rank0]: TransportError: rank 1 (stage 1, replica 0) closed the link\n"
                   "aqpipe: /mnt/run holds this run: it continues after step 28, the newest checkpoint whose parts "
                   "are all held; the checkpoint of step 32 had no copies on other hosts\n")
    assert continued_after(hosts, offset) == "28"
    offset = log.stat().st_size
    with log.open("a") as more:  # (a rank 0 that finds the checkpoint it named damaged names an older one next)
        more.write("aqpipe: resuming after step 36: the checkpoint of step 40 is not held by rank 2\n"
                   "aqpipe: resuming after step 32: the checkpoint of step 36 is not complete and sound\n")
    assert continued_after(hosts, offset) == "32"
