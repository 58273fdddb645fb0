"""Small name → factory registries, so config picks implementations by name.

A registry refuses to overwrite a name with a different object (verl's lesson: silent
overwrites hide plugin bugs) and an unknown name fails with the list of known ones.

Example::

    >>> from nemo_factuality.registry import Registry
    >>> COLORS = Registry("color")
    >>> @COLORS.register("red")
    ... class Red:
    ...     def __init__(self, shade: int = 1): self.shade = shade
    >>> COLORS.build({"name": "red", "shade": 3}).shade
    3
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Unknown name, duplicate registration, or bad constructor arguments."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps short names to factories (classes or functions)."""

    def __init__(self, kind: str, *, lazy_modules: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self._items: dict[str, Callable[..., T]] = {}
        self._options: dict[str, type] = {}
        # Modules imported on first lookup so their @register decorators have run.
        self._lazy_modules = lazy_modules
        self._loaded = False

    def register(self, name: str, *, options: type | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """``options``: the dataclass a factory taking ``**options`` builds from them (a reward's config), so an
        unknown option is refused before anything is built, as for a factory with named parameters."""
        if options is not None:
            self._options[name] = options

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            existing = self._items.get(name)
            if existing is not None and existing is not factory:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
                    f"pick another name for {factory.__module__}.{factory.__qualname__}"
                )
            self._items[name] = factory
            return factory

        return deco

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._lazy_modules:
            importlib.import_module(module)

    def get(self, name: str) -> Callable[..., T]:
        self._ensure_loaded()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise RegistryError(f"Unknown {self.kind} {name!r}. Known {self.kind}s: {known}") from None

    def build(self, spec: Mapping[str, Any] | str, **extra: Any) -> T:
        """Build from ``"name"`` or ``{"name": ..., **kwargs}``; ``extra`` kwargs are added (e.g. a judge client)."""
        factory, kwargs = self._checked(spec, extra)
        return factory(**kwargs)

    def check(self, spec: Mapping[str, Any] | str, **extra: Any) -> Callable[..., T]:
        """Raise what ``build`` would about ``spec`` (unknown name, unknown or missing options) without building
        anything; returns the factory. Lets a command validate its whole config before doing any work."""
        return self._checked(spec, extra)[0]

    def _checked(self, spec: Mapping[str, Any] | str, extra: Mapping[str, Any]) -> tuple[Callable[..., T], dict[str, Any]]:
        if isinstance(spec, str):
            name, kwargs = spec, {}
        else:
            kwargs = dict(spec)
            if "name" not in kwargs:
                raise RegistryError(f"{self.kind} config needs a 'name' key, got keys {sorted(kwargs)}")
            name = kwargs.pop("name")
        factory = self.get(name)
        kwargs.update(extra)
        _check_kwargs(self.kind, name, factory, kwargs)
        if name in self._options:
            from nemo_factuality.config import options_for

            named = set(inspect.signature(factory).parameters)
            options_for(self._options[name], {k: v for k, v in kwargs.items() if k not in named}, self.kind)
        return factory, kwargs

    def names(self) -> list[str]:
        self._ensure_loaded()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self._ensure_loaded()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _check_kwargs(kind: str, name: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Report every unknown or missing argument at once, before anything is built."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    missing = sorted(
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and n not in kwargs
    )
    problems = []
    if unknown:
        problems.append(f"unknown option(s) {unknown}")
    if missing:
        problems.append(f"missing required option(s) {missing}")
    if problems:
        accepted = ", ".join(n for n in params if n != "self")
        raise RegistryError(f"{kind} {name!r}: {'; '.join(problems)}. Accepted options: {accepted}")


# The project's registries. Implementations live in the named modules and register on import.
SEGMENTERS: Registry[Any] = Registry("segmenter", lazy_modules=("nemo_factuality.text.segment",))
EXTRACTORS: Registry[Any] = Registry("claim extractor", lazy_modules=("nemo_factuality.claims",))
EVIDENCE: Registry[Any] = Registry("evidence provider", lazy_modules=("nemo_factuality.knowledge.evidence",))
VERIFIERS: Registry[Any] = Registry("verifier", lazy_modules=("nemo_factuality.verify",))
REWARDS: Registry[Any] = Registry("reward", lazy_modules=("nemo_factuality.rewards", "nemo_factuality.lab.reward",
                                                           "nemo_factuality.lab.method_rewards"))


def build_reward(spec: Mapping[str, Any], tokenizer: Any = None) -> Any:
    """A method reward from its config block, handed the policy's ``tokenizer`` (an object or a local path) when
    its factory takes one and the block names none: without it RLFH has no token rewards and FSPO no token signs,
    and a stage would silently train on the scalar alone (in-process and served rewards alike)."""
    spec = dict(spec)
    factory = REWARDS.get(spec["name"])
    if tokenizer is not None and spec.get("tokenizer") is None and "tokenizer" in inspect.signature(factory).parameters:
        spec["tokenizer"] = tokenizer
    return REWARDS.build(spec)
