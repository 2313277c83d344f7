"""dppo.launch.run.run: the main job's terminal report (in-process, no Ray) and who shuts Ray down."""

import json
from types import SimpleNamespace

import pytest

import dppo.trainer.placement
import dppo.trainer.ppo
from dppo.cli import main
from dppo.launch.run import run
from dppo.trainer.base import RunResult


def test_run_prints_the_summary_and_where_it_wrote_its_outputs(small_cfg, capsys):
    cfg = small_cfg(**{"trainer.total_steps": 1, "algorithm.prox_anchor": "current"})
    result = run(cfg)  # prints to the sys.stdout of the moment (here: pytest's capture), not the one at import
    printed = capsys.readouterr().out
    out_dir = result.output_dir
    assert f"metrics: {out_dir / 'metrics.jsonl'}" in printed
    assert f"plot:    {out_dir / 'training_curves.png'}" in printed
    assert f"summary: {out_dir / 'summary.json'}" in printed
    assert "reward, last 10% of steps" in printed and result.summary_table() in printed
    assert (out_dir / "config.yaml").read_text().startswith("trainer:")
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["summary"]["global steps"] == "1"


class _FitFailed(RuntimeError):
    pass


@pytest.mark.parametrize("fit_fails", [False, True])
@pytest.mark.parametrize("already_up", [False, True])
def test_run_shuts_down_only_a_ray_cluster_it_started(small_cfg, monkeypatch, tmp_path, already_up, fit_fails):
    """ray.init and ray.shutdown are recorded, the trainer is a stand-in: run()'s Ray bookkeeping is under test."""
    import ray

    calls, state = [], {"up": already_up}
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "init", lambda **kwargs: (calls.append("init"), state.update(up=True)))
    monkeypatch.setattr(ray, "shutdown", lambda: (calls.append("shutdown"), state.update(up=False)))

    class StandInTrainer:
        def __init__(self, cfg, source=None, resume_point=None, pi_old_choice=None, rollout=None, stop_after=None):
            self.output_dir, self.resumed_from, self.rollout = tmp_path, None, None
            self.actor_group = SimpleNamespace(describe=lambda: "actor: 1 rank(s), plain module: stand-in")

        def close(self):
            pass

        def fit(self):
            if fit_fails:
                raise _FitFailed("training failed")
            return RunResult(
                tmp_path,
                tmp_path / "metrics.jsonl",
                None,
                tmp_path / "summary.json",
                [],
                {},
                [("global steps", "0")],
                0.0,
            )

    monkeypatch.setattr(dppo.trainer.ppo, "PPOTrainer", StandInTrainer)
    monkeypatch.setattr(
        dppo.trainer.placement, "pool_nodes", lambda trainer, rollout: None
    )  # the pools fit (no real cluster here)
    cfg = small_cfg(**{"ray.enabled": True})
    if fit_fails:
        with pytest.raises(_FitFailed):
            run(cfg)
    else:
        run(cfg)
    assert calls == ([] if already_up else ["init", "shutdown"])
    assert state["up"] is already_up  # the caller's cluster stays up; ours is gone, also after a failure


@pytest.mark.parametrize("how", ["ray.address", "RAY_ADDRESS"])
def test_an_unreachable_cluster_is_one_line_naming_the_address_and_the_auth_settings(
    small_cfg, monkeypatch, capsys, how
):
    """ray.init's ConnectionError (what Ray raises once its retries are spent, e.g. on a token mismatch) becomes
    `dppo: error: ...` naming the address and how to pass the cluster's token, exit code 5, no traceback."""
    import ray

    from dppo.launch import ray_cluster

    def refuse(**kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray_cluster, "probe", lambda address: None)  # the address answers; Ray refuses
    address = "10.0.0.7:6379"
    args = ["trainer.total_steps=1", "trainer.output_dir=" + str(small_cfg().trainer.output_dir)]
    if how == "ray.address":
        args.append(f"ray.address={address}")
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    assert main(["train", *args]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dppo: error: could not join the Ray cluster at '10.0.0.7:6379'")
    assert "RAY_AUTH_MODE=token" in err[0] and "Failed to connect to Ray cluster at 10.0.0.7:6379" in err[0]


def test_a_local_cluster_that_fails_to_start_keeps_rays_own_error(small_cfg, monkeypatch):
    import ray

    from dppo.launch.ray_cluster import RayConnectError, init_ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: (_ for _ in ()).throw(ConnectionError("no local raylet")))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConnectionError, match="no local raylet") as err:
        init_ray(small_cfg(**{"ray.enabled": True}).ray)
    assert not isinstance(err.value, RayConnectError)


@pytest.mark.parametrize(
    "address, env, expected",
    [(None, None, "local"), (None, "", "local"), ("auto", None, "auto"), (None, "10.0.0.7:6379", "10.0.0.7:6379")],
)
def test_no_address_always_starts_a_new_local_cluster(small_cfg, monkeypatch, address, env, expected):
    """Without ray.address and RAY_ADDRESS Ray is told address="local" (a new cluster, never a stray `ray start`
    one); auto and a given address are passed on (after the probe)."""
    import ray

    from dppo.launch import ray_cluster

    calls, probed = [], []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_cluster, "probe", probed.append)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert ray_cluster.init_ray(small_cfg(**{"ray.enabled": True, "ray.address": address}).ray)
    assert [c["address"] for c in calls] == [expected] and probed == [expected]


def test_the_probe_refuses_what_is_not_a_grpc_server_at_once(tmp_path):
    """A closed port and a server that does not speak HTTP/2 are one RayConnectError each, in well under Ray's
    minutes of retries."""
    import socket
    import threading
    import time

    from dppo.launch.ray_cluster import RayConnectError, probe

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(RayConnectError, match=rf"could not join the Ray cluster at '127.0.0.1:{port}'"):
        probe(f"127.0.0.1:{port}")
    server = socket.create_server(("", 0))  # Ray (and the probe) resolve 127.0.0.1 to this node's address
    port = server.getsockname()[1]

    def answer_http1():
        conn, _ = server.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=answer_http1, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(RayConnectError, match="answers, but not as a Ray cluster"):
        probe(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 5
    server.close()


def test_an_unreachable_address_is_one_line_and_exit_code_5_at_once(small_args, capsys, monkeypatch):
    """`dppo train ray.address=127.0.0.1:1` (nothing listens there): Ray alone would retry for minutes."""
    import time

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    start = time.monotonic()
    code = main(
        ["train", *small_args(**{"ray.enabled": True, "trainer.mode": "separate_async"}), "ray.address=127.0.0.1:1"]
    )
    assert time.monotonic() - start < 30 and code == 5
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dppo: error: could not join the Ray cluster at '127.0.0.1:1'")
