"""A function from a user's Python file, named in the config (custom_reward_function.path/name, rollout.agent.path/
name): read once where the config is read, carried as text, and compiled again in each process that calls it, so a
worker needs neither the file nor its module on its path.

    fn = FileFunction(path, name, "custom_reward_function", UserCodeError)   # reads and compiles now: errors early
    fn.function()                                                            # the callable (compiled once per process)
"""

from __future__ import annotations

import types
from collections.abc import Callable

from dppo._text import one_line
from dppo.data.errors import DataFileError


class FileFunction:
    """The function `name` of the Python file at `path`; picklable (it carries the file's text, not the function).
    key: the config section that names it (messages say key.path=..., key.name=...); error: the exception type of a
    file that fails to load or lacks the name (a DataFileError if it cannot be read)."""

    def __init__(self, path: str, name: str, key: str, error: type[Exception]):
        self.path, self.name, self.key, self.error = path, name, key, error
        try:
            with open(path, encoding="utf-8") as f:
                self._source = f.read()
        except OSError as err:
            raise DataFileError(f"{key}.path={path!r}: cannot read it ({one_line(err, None)})") from None
        self._fn: Callable | None = None
        self.function()  # compile now: a broken file or a missing name fails before any worker starts

    @property
    def label(self) -> str:
        """How messages name it: 'compute_score' in 'my_reward.py'."""
        return f"{self.name!r} in {self.path!r}"

    def function(self) -> Callable:
        if self._fn is None:
            self._fn = self._compile()
        return self._fn

    def _compile(self) -> Callable:
        module = types.ModuleType(f"dppo_user_{self.key.replace('.', '_')}")
        module.__file__ = self.path
        try:
            exec(compile(self._source, self.path, "exec"), module.__dict__)  # noqa: S102 - the user's own file
        except Exception as err:
            raise self.error(
                f"{self.key}.path={self.path!r} failed to load: {type(err).__name__}: {one_line(err, None)}"
            ) from err
        fn = getattr(module, self.name, None)
        if not callable(fn):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise self.error(
                f"{self.key}.path={self.path!r} defines no function {self.key}.name={self.name!r}; it defines: "
                f"{', '.join(defined) or 'none'}"
            )
        return fn

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fn": None}
