"""Streamer on the CPU: zero-copy views of the slot handed out step by step, with the ordering rules
that the staged CUDA path needs (so code written against one runs on the other)."""

from __future__ import annotations

import pytest
import torch

from dppo.snapshot import EmptySlotError, SnapshotError, SnapshotPool, UnknownTensorError


def _schedule(model) -> list[list[str]]:
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    steps = [["embed.weight"]]
    for i in range(len(model.layers)):
        steps.append([n for n in names if n.startswith(f"layers.{i}.")])
    steps.append(["head.weight"])  # tied with embed.weight: used first and last
    return steps


@pytest.fixture
def saved(tiny_lm, perturb, state):
    model = tiny_lm()
    pool = SnapshotPool(model)
    saved = state(model)
    pool.save(0)
    pool.fence()
    perturb(model)
    return model, pool, saved, state(model)


def test_acquired_views_equal_the_saved_tensors_bitwise_and_copy_nothing(saved, bits, state, assert_bitwise):
    model, pool, expected, live = saved
    schedule = _schedule(model)
    slot_views = pool.view(0)
    with pool.streamer(0, schedule) as st:
        assert st.steps == len(schedule) and st.mode == "host" and st.staging_bytes == 0
        for i, names in enumerate(schedule):
            params = st.acquire(i)
            assert list(params) == names
            for name, t in params.items():
                assert torch.equal(bits(t), bits(expected[name]))
                assert t.data_ptr() == slot_views[name].data_ptr()  # zero copies
            st.release(i)
    assert_bitwise(state(model), live)
    stream = pool.stats()["stream"]
    assert (stream["count"], stream["bytes"]) == (1, 0)  # the pass is counted; it copied nothing


def test_every_pass_counts_as_one_stream_op_and_a_pass_that_never_began_does_not(saved):
    model, pool, _, _ = saved
    schedule = _schedule(model)
    for passes in (1, 2):
        with pool.streamer(0, schedule) as st:
            for i in range(st.steps):
                st.acquire(i)
                st.release(i)
        stream = pool.stats()["stream"]
        assert (stream["count"], stream["bytes"], stream["seconds"]) == (passes, 0, 0.0)
    st = pool.streamer(0, schedule)
    pool.clear(0)
    with pytest.raises(EmptySlotError):
        st.begin()
    assert pool.stats()["stream"]["count"] == 2


def test_streamed_forward_equals_the_saved_models_output(saved, tiny_lm):
    model, pool, expected, _ = saved
    reference = tiny_lm()
    reference.load_state_dict({k: v for k, v in expected.items()}, strict=False)
    tokens = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        want = reference(tokens)
        with pool.streamer(0, _schedule(model)) as st:
            h = torch.nn.functional.embedding(tokens, st.acquire(0)["embed.weight"])
            st.release(0)
            for i, layer in enumerate(model.layers, start=1):
                params = {k.removeprefix(f"layers.{i - 1}."): v for k, v in st.acquire(i).items()}
                h = h + torch.func.functional_call(layer, params, (h,))
                st.release(i)
            last = st.steps - 1
            out = torch.nn.functional.linear(h, st.acquire(last)["head.weight"]) * model.scale
            st.release(last)
    assert torch.equal(out, want)


def test_out_of_order_use_is_a_clear_error(saved):
    model, pool, _, _ = saved
    st = pool.streamer(0, _schedule(model))
    with pytest.raises(SnapshotError, match="not begun"):
        st.acquire(0)
    st.begin()
    with pytest.raises(SnapshotError, match="already begun"):
        st.begin()
    with pytest.raises(SnapshotError, match=r"acquired in order; the next one is 0"):
        st.acquire(1)
    with pytest.raises(SnapshotError, match=r"expected release\(0\) after acquire\(0\)"):
        st.release(0)
    st.acquire(0)
    st.acquire(1)
    with pytest.raises(SnapshotError, match=r"acquire\(2\) before release\(0\)"):
        st.acquire(2)
    with pytest.raises(SnapshotError, match=r"expected release\(0\)"):
        st.release(1)
    with pytest.raises(ValueError, match=r"step out of range \[0, 5\)"):
        st.acquire(9)
    st.release(0)
    st.acquire(2)
    st.end()
    st.end()  # idempotent
    with st:  # reusable after end()
        st.acquire(0)


def test_schedule_and_slot_are_validated(saved):
    model, pool, _, _ = saved
    with pytest.raises(UnknownTensorError, match="no tensor named 'layers.9.weight'"):
        pool.streamer(0, [["embed.weight"], ["layers.9.weight"]])
    with pytest.raises(EmptySlotError, match="slot 3 is empty"):
        pool.streamer(3, _schedule(model))
    st = pool.streamer(0, _schedule(model))
    pool.clear(0)
    with pytest.raises(EmptySlotError):
        st.begin()


def test_a_slot_overwritten_during_a_pass_keeps_streaming_the_old_snapshot(saved, bits):
    model, pool, expected, _ = saved
    with pool.streamer(0, _schedule(model)) as st:
        pool.save(0)  # copy on write: the pass holds the old arena
        params = st.acquire(0)
    assert torch.equal(bits(params["embed.weight"]), bits(expected["embed.weight"]))
