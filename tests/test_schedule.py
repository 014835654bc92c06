"""The GPipe instruction stream, checked alone: completeness, order, and deadlock freedom across stages."""

from collections import deque

import pytest

from aqpipe.runtime import schedule as s


def simulate(stages: int, micro_batches: int) -> list[list[s.Instruction]]:
    """Run every stage's stream with blocking receives and asynchronous sends; fail on deadlock or mismatch."""
    streams = [deque(s.gpipe(k, stages, micro_batches)) for k in range(stages)]
    # wires[(src, dst)] holds the micro-batch numbers sent and not yet received, in order
    wires: dict[tuple[int, int], deque] = {}
    done: list[list[s.Instruction]] = [[] for _ in range(stages)]
    while any(streams):
        progressed = False
        for k, stream in enumerate(streams):
            while stream:
                ins = stream[0]
                if isinstance(ins, s.RecvActivation):
                    wire = wires.get((k - 1, k))
                    if not wire:
                        break
                    assert wire.popleft() == ins.micro_batch, "activations arrive out of order"
                elif isinstance(ins, s.RecvGrad):
                    wire = wires.get((k + 1, k))
                    if not wire:
                        break
                    assert wire.popleft() == ins.micro_batch, "gradients arrive out of order"
                elif isinstance(ins, s.SendActivation):
                    wires.setdefault((k, k + 1), deque()).append(ins.micro_batch)
                elif isinstance(ins, s.SendGrad):
                    wires.setdefault((k, k - 1), deque()).append(ins.micro_batch)
                done[k].append(stream.popleft())
                progressed = True
        assert progressed, f"deadlock with {stages} stages and {micro_batches} micro-batches"
    assert all(not w for w in wires.values()), "a message was sent and never received"
    return done


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 7, 16])
def test_gpipe_stream_is_complete_ordered_and_deadlock_free(stages, micro_batches):
    executed = simulate(stages, micro_batches)
    for k, stream in enumerate(executed):
        first, last = k == 0, k == stages - 1
        kinds = [type(i) for i in stream]
        expected_per_mb = {s.Forward: 1, s.Backward: 1, s.LoadMicroBatch: 1 if (first or last) else 0,
                           s.RecvActivation: 0 if first else 1, s.SendActivation: 0 if last else 1,
                           s.RecvGrad: 0 if last else 1, s.SendGrad: 0 if first else 1}
        for cls, count in expected_per_mb.items():
            mbs = [i.micro_batch for i in stream if type(i) is cls]
            assert sorted(mbs) == sorted(list(range(micro_batches)) * count), (k, cls.__name__)
        assert kinds[-2:] == [s.ReduceGrads, s.OptimizerStep]
        position = {(type(i), i.micro_batch): n for n, i in enumerate(stream)}
        for mb in range(micro_batches):
            assert position[(s.Forward, mb)] < position[(s.Backward, mb)]
            if not first:
                assert position[(s.RecvActivation, mb)] < position[(s.Forward, mb)]
                assert position[(s.Backward, mb)] < position[(s.SendGrad, mb)]
            if last and not first:  # targets are looked up by the ids that arrived
                assert position[(s.RecvActivation, mb)] < position[(s.LoadMicroBatch, mb)]
            if not last:
                assert position[(s.Forward, mb)] < position[(s.SendActivation, mb)]
                assert position[(s.RecvGrad, mb)] < position[(s.Backward, mb)]
        # GPipe: all forwards before any backward
        last_forward = max(n for n, i in enumerate(stream) if isinstance(i, s.Forward))
        first_backward = min(n for n, i in enumerate(stream) if isinstance(i, s.Backward))
        assert last_forward < first_backward


def test_backward_runs_micro_batches_in_forward_order():
    stream = s.gpipe(1, 3, 4)
    assert [i.micro_batch for i in stream if isinstance(i, s.Backward)] == [0, 1, 2, 3]


@pytest.mark.parametrize("args", [(3, 3, 2), (-1, 2, 2), (0, 2, 0)])
def test_bad_schedule_arguments_are_rejected(args):
    with pytest.raises(ValueError):
        s.gpipe(*args)
