"""The schedules' instruction streams, checked alone (no torch): completeness, order, deadlock freedom across
stages, and how many micro-batches each stage holds."""

from collections import deque

import pytest

from aqpipe.pipeline.vocab import schedule as s


def simulate(stages: int, micro_batches: int, schedule: str = "gpipe") -> list[list[s.Instruction]]:
    """Run every stage's stream with blocking receives and asynchronous sends; fail on deadlock or mismatch."""
    streams = [deque(s.SCHEDULES[schedule].stream(k, stages, micro_batches)) for k in range(stages)]
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


def in_flight(stream: list[s.Instruction]) -> int:
    """The most micro-batches a stream holds at once: forwarded, not yet backwarded."""
    held, most = 0, 0
    for ins in stream:
        held += isinstance(ins, s.Forward) - isinstance(ins, s.Backward)
        most = max(most, held)
    return most


@pytest.mark.parametrize("schedule", list(s.SCHEDULES))
@pytest.mark.parametrize("stages", range(1, 9))
def test_every_stream_is_complete_ordered_and_deadlock_free(schedule, stages):
    for micro_batches in range(1, 17):
        check_complete_and_ordered(simulate(stages, micro_batches, schedule), stages, micro_batches)


def check_complete_and_ordered(executed: list[list[s.Instruction]], stages: int, micro_batches: int) -> None:
    """Each stage ran every instruction a micro-batch needs once, in an order that respects its data."""
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
        # backwards run in forward order on every stage, so gradients accumulate as in a single process
        assert [i.micro_batch for i in stream if isinstance(i, s.Backward)] == list(range(micro_batches))


@pytest.mark.parametrize("schedule", list(s.SCHEDULES))
def test_the_last_gradient_of_a_step_follows_every_activation_of_the_step(schedule):
    """What the re-seed protocol relies on: on each stage the last gradient sent comes after every activation it
    receives (the request is about the next step only), and the last gradient received after every activation it
    sends (the sender forgets before it encodes the next step)."""
    for stages in range(2, 9):
        for micro_batches in range(1, 17):
            for k in range(stages):
                stream = s.SCHEDULES[schedule].stream(k, stages, micro_batches)
                at = {type(i): n for n, i in enumerate(stream)}  # the last position of each kind
                if k > 0:
                    assert at[s.SendGrad] > at[s.RecvActivation]
                if k < stages - 1:
                    assert at[s.RecvGrad] > at[s.SendActivation]


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 3, 8, 16])
def test_gpipe_runs_every_forward_before_any_backward(stages, micro_batches):
    for stream in simulate(stages, micro_batches, "gpipe"):
        last_forward = max(n for n, i in enumerate(stream) if isinstance(i, s.Forward))
        first_backward = min(n for n, i in enumerate(stream) if isinstance(i, s.Backward))
        assert last_forward < first_backward
        assert in_flight(stream) == micro_batches


@pytest.mark.parametrize("stages", range(1, 9))
def test_1f1b_holds_at_most_pp_minus_stage_micro_batches(stages):
    for micro_batches in range(1, 17):
        for k, stream in enumerate(simulate(stages, micro_batches, "1f1b")):
            assert in_flight(stream) == min(stages - k, micro_batches), (stages, micro_batches, k)


@pytest.mark.parametrize("stages", range(1, 9))
def test_eager_1f1b_holds_at_most_twice_pp_minus_stage_minus_one_micro_batches(stages):
    for micro_batches in range(1, 17):
        for k, stream in enumerate(simulate(stages, micro_batches, "eager-1f1b")):
            assert in_flight(stream) == min(2 * (stages - k) - 1, micro_batches), (stages, micro_batches, k)


def test_eager_1f1b_alternates_after_its_deeper_warm_up():
    """Stage 0 of 2 with 8 micro-batches: 3 warm-up forwards (1F1B: 2), then pairs, then 3 backwards."""
    kinds = ["F" if isinstance(i, s.Forward) else "B" for i in s.eager_one_f_one_b(0, 2, 8)
             if isinstance(i, (s.Forward, s.Backward))]
    assert "".join(kinds) == "FFF" + "BF" * 5 + "BBB"


def test_1f1b_alternates_in_the_steady_state():
    """Stage 1 of 4 with 8 micro-batches: 3 warm-up forwards, then backward/forward pairs, then 3 backwards."""
    kinds = ["F" if isinstance(i, s.Forward) else "B" for i in s.one_f_one_b(1, 4, 8)
             if isinstance(i, (s.Forward, s.Backward))]
    assert "".join(kinds) == "FFF" + "BF" * 5 + "BBB"


def test_the_last_stage_of_1f1b_sends_each_gradient_as_soon_as_its_forward_is_done():
    stream = s.one_f_one_b(2, 3, 3)
    assert [repr(i) for i in stream[:5]] == ["RecvActivation(0)", "LoadMicroBatch(0)", "Forward(0)", "Backward(0)",
                                             "SendGrad(0)"]


def test_backward_runs_micro_batches_in_forward_order():
    stream = s.gpipe(1, 3, 4)
    assert [i.micro_batch for i in stream if isinstance(i, s.Backward)] == [0, 1, 2, 3]


@pytest.mark.parametrize("schedule", list(s.SCHEDULES))
@pytest.mark.parametrize("args", [(3, 3, 2), (-1, 2, 2), (0, 2, 0)])
def test_bad_schedule_arguments_are_rejected(schedule, args):
    with pytest.raises(ValueError):
        s.SCHEDULES[schedule].stream(*args)
