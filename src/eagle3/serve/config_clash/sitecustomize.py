"""Lets an engine register a transformers config name that transformers already has.

SGLang 0.5.14 registers `qwen3_asr` with AutoConfig.register, and transformers 5.17 ships a config
of that name, so importing SGLang's configs fails (`ValueError: 'qwen3_asr' is already used by a
Transformers config`). For an engine launched with serve.tolerate_config_names, eagle3.serve.launch puts
this folder first on PYTHONPATH and the names in EAGLE3_TOLERATED_CONFIG_NAMES; Python imports this
file at the start of the engine and of every process it spawns. When transformers' config registry
is imported, its register() is wrapped to register those names with exist_ok=True: the engine's
class replaces transformers' own for that name, as the engine expects. Other names still raise.
A sitecustomize this folder shadows is run afterwards.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

NAMES = frozenset(n for n in os.environ.get("EAGLE3_TOLERATED_CONFIG_NAMES", "").split(",") if n)
REGISTRY_MODULE = "transformers.models.auto.configuration_auto"
HERE = os.path.dirname(os.path.abspath(__file__))


def tolerate(module) -> None:
    """Wrap the config registry's register() (AutoConfig.register goes through it)."""
    mapping = type(module.CONFIG_MAPPING)
    original = mapping.register

    def register(self, key, value, exist_ok=False):
        return original(self, key, value, exist_ok=exist_ok or key in NAMES)

    mapping.register = register


class RegistryFinder(importlib.abc.MetaPathFinder):
    """Finds transformers' config registry module as usual and wraps it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            tolerate(module)

        spec.loader.exec_module = exec_module
        return spec


def run_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if NAMES:
    sys.meta_path.insert(0, RegistryFinder())
run_shadowed_sitecustomize()
