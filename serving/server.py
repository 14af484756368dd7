"""Assemble one server: target + drafter source -> manager, policy, engine, trace writer, metrics, audit."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from dspark_core.model.target import Target

from .audit import AuditLog
from .drafters import DrafterSource
from .engine import Engine
from .manager import DrafterManager
from .metrics import ServingMetrics
from .policy import build_policy
from .settings import ServeSettings
from .trace_writer import TraceWriter

log = logging.getLogger("dspark.serving")


@dataclass
class ServerState:
    settings: ServeSettings
    target: Target
    model_name: str
    domains: list[str]
    default_domain: str
    context_length: int
    metrics: ServingMetrics
    audit: AuditLog
    manager: DrafterManager
    engine: Engine
    writer: TraceWriter | None
    policy_info: str

    def start(self) -> None:
        if self.writer is not None:
            self.writer.start()
        self.engine.start()
        self.manager.start_polling()

    def stop(self) -> None:
        self.manager.stop()
        self.engine.stop()
        if self.writer is not None:
            self.writer.close()


def served_domains(settings: ServeSettings, source: DrafterSource) -> tuple[list[str], str]:
    """--domains, else the source's domains, else just the default; the default is always served."""
    domains = list(settings.domains)
    if not domains:
        try:
            domains = source.domains()
        except Exception as e:         # an unreachable registry still lets the server start (no speculation)
            log.error("could not list the registry's domains: %s", e)
            domains = []
    default = settings.default_domain
    if default not in domains:
        domains.append(default)
    return domains, default


def build_server(settings: ServeSettings, target: Target, source: DrafterSource) -> ServerState:
    """Load every domain's drafter (alias ``settings.alias``), choose the policy, wire the engine. Nothing
    runs until :meth:`ServerState.start`."""
    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; the server needs one to read prompts")
    metrics = ServingMetrics()
    audit = AuditLog(settings.audit_path)
    domains, default = served_domains(settings, source)
    manager = DrafterManager(source, settings, metrics, audit, domains)
    manager.start_up()
    policy, tables, info = build_policy(settings.policy, manager.loaded(), target.runner, settings.sps_path,
                                        settings.live_gate, settings.gate_hurdle,
                                        settings.gate_explore_budget, settings.length_gate)
    log.info("policy: %s", info)
    writer = None
    if settings.traces:
        writer = TraceWriter(settings.landing_dir, settings.trace_buffer, settings.trace_rotate_bytes,
                             settings.trace_rotate_seconds, on_written=metrics.traces_written.inc,
                             on_dropped=metrics.traces_dropped.inc, server_id=uuid.uuid4().hex[:8])
    engine = Engine(target.runner, target.tokenizer, manager, policy, metrics, target.fingerprint,
                    max_batch=settings.max_batch, shadow_fraction=settings.shadow_fraction,
                    trace_sink=writer.submit if writer is not None else None, sps_tables=tables,
                    trim_interval=settings.memory_trim_interval)
    ctx = settings.max_model_len or int(getattr(target.hf_config, "max_position_embeddings", 2048) or 2048)
    return ServerState(settings, target, settings.served_model_name or target.name, domains, default, ctx,
                       metrics, audit, manager, engine, writer, info)
