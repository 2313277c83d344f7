"""Ray's own lines for a worker death stay out of what the driver prints (dppo says each death in its own line);
everything else the raylet or a worker sends is printed as before."""

from ray._private import worker as ray_worker

from dppo.launch.ray_cluster import _quiet_ray_death_lines

DIED = (
    "A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the "
    "problem, check the logs for the dead worker. RayTask ID: ffff Worker exit type: SYSTEM_ERROR"
)
OOM = (
    "1 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed due to other reasons at "
    "node (ID: c50e95a2, IP: 192.0.2.2) over the last time period."
)


def test_rays_death_lines_are_left_out_and_the_rest_is_printed(monkeypatch, capsys):
    printed = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data))
    _quiet_ray_death_lines()
    _quiet_ray_death_lines()  # once is enough: a second call does not wrap it again
    show = ray_worker.print_to_stdstream
    show({"lines": [DIED], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    show({"lines": [OOM], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    show({"lines": [DIED, "The node has 2 GB free"], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    show({"lines": [DIED], "pid": 4242, "is_err": True}, ignore_prefix=False)  # a worker's own output: kept
    assert printed == [
        {"lines": ["The node has 2 GB free"], "pid": "raylet", "is_err": False},
        {"lines": [DIED], "pid": 4242, "is_err": True},
    ]
