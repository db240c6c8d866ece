"""The engines a job measures: a started server behind its HTTP API (Served), or with serve.inprocess
one in this process (eagle3.serve.inprocess answers the same calls)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import httpx

from eagle3.bench.client import run_requests
from eagle3.core.config import BenchConfig, EngineConfig, ServeConfig
from eagle3.core.spec import Spec
from eagle3.serve import inprocess
from eagle3.serve.counters import read_counters
from eagle3.serve.launch import EngineFailed, EngineProcess, EngineSetup, sized_for, start_engine


class Served:
    """An engine process measured through its HTTP API (the in-process engines of
    eagle3.serve.inprocess answer the same calls); `model` names the target in OpenAI requests."""

    def __init__(self, process: EngineProcess, serve: ServeConfig, model: str):
        self.process, self.scfg, self.model = process, serve, model

    def run(self, requests, bcfg: BenchConfig, desc: str) -> tuple[list[dict], float]:
        timeout_s = self.scfg.request_timeout_s
        return run_requests(self.process, requests, bcfg, timeout_s, self.model, desc)

    def counters(self) -> dict:
        try:
            return read_counters(
                self.scfg.engine, self.process.base_url, headers=self.process.launch.headers
            )
        except httpx.HTTPError as err:
            self.process.check_alive(grace_s=5)
            raise EngineFailed(
                f"{self.scfg.engine} stats request failed: {err}", self.process.log_tail()
            ) from err

    def check_alive(self) -> None:
        self.process.check_alive()

    def stop(self) -> None:
        self.process.stop(self.scfg.stop_timeout_s)


def open_engine(
    setup: EngineSetup, load_target: Callable, target_path, spec: Spec, drafter_path, folder: Path
):
    """The engine a job measures with `spec`: a started server, or with serve.inprocess one in this
    process (serve=hf runs the target `load_target()` gives); its setup has the job's engine
    section (job_engine) and a server sized for bench.batch_size requests (job_setup). A job binds
    setup, load_target and target_path (functools.partial) and hands the rest of the bench the
    opener."""
    setup = job_setup(setup, spec)
    if setup.serve.inprocess:
        return inprocess.engine_for(setup, spec, drafter_path, load_target)
    process = start_engine(setup, spec, drafter_path, target_path, folder)
    return Served(process, setup.serve, str(target_path))


def job_setup(setup: EngineSetup, spec: Spec) -> EngineSetup:
    """The setup a job's engine starts from: the job's engine section (job_engine) and serving
    settings sized for bench.batch_size requests in flight (serve.launch.sized_for: SGLang's CUDA
    graphs, vLLM's scheduler)."""
    engine, serve = job_engine(setup.engine, spec), sized_for(setup.serve, setup.batch_size)
    if engine is setup.engine and serve is setup.serve:
        return setup
    return dataclasses.replace(setup, engine=engine, serve=serve)


def job_engine(engine: EngineConfig, spec: Spec) -> EngineConfig:
    """The engine section a job's engine is built from: the job's spec at every step
    (engine.schedule=auto counts as off here, so a shape sweep measures each shape; spec=off never
    runs a schedule); a schedule file given by path applies to the job's engine."""
    setting = str(engine.schedule)
    if setting == "off" or (spec.enabled and setting != "auto"):
        return engine
    return dataclasses.replace(engine, schedule="off")
