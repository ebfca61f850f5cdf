"""The Flower ServerApp and ClientApp, assembled from the federation library.

``federated/`` (what ``flwr run federated`` ships) and the simulation stage build their apps
here, so deployment and simulation run the same code; they differ only in how a node finds its
data (node config vs. a partition map) and how the server finds its inputs (run config vs.
the Hydra config).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flwr.app import Context
from flwr.client import ClientApp
from flwr.client.mod import secaggplus_mod
from flwr.server import ServerApp
from flwr.serverapp.grid import Grid
from flwr.supercore.run import RunNotRunningException

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.client import Contributor, Node
from nimmer_train.federation.mods import (
    clip_mod,
    drill_mod,
    equal_weight_mod,
    refusal_mod,
    unmask_guard_mod,
    validate_mod,
)

if TYPE_CHECKING:  # the server side needs torch; a SuperNode's per-message processes should not
    from nimmer_train.federation.checkpoint import ServerState
    from nimmer_train.federation.rounds import Report, ServerSetup

NodeOf = Callable[[Context], Node]


def client_app(
    node_of: NodeOf,
    secure_aggregation: bool = True,
    drills: Callable[[Context], dict[int, str]] | None = None,
    extra_mods: list[Any] | None = None,
) -> ClientApp:
    """A ClientApp whose updates are validated, turned into clipped contributions (update and A.1
    indicator), equally weighted, stripped of every plaintext metric but the A.2 step, and (by
    default) masked; a device that takes no part answers with a one-line refusal.

    With ``secure_aggregation`` the client cannot send an unmasked update: a plain fit request
    fails in ``secaggplus_mod``. Only a simulation may turn it off.
    """

    def client_fn(context: Context) -> Any:
        logging.getLogger("flwr").setLevel(logging.INFO)  # in a simulation worker: no per-node DEBUG lines
        faults = drills(context) if drills else {}
        crash = frozenset(r for r, f in faults.items() if f == "crash")
        return Contributor(node_of(context), crash).to_client()

    mods = [equal_weight_mod, clip_mod, validate_mod, *(extra_mods or [])]  # extra: innermost (benchmarks)
    if secure_aggregation:
        mods[:0] = [unmask_guard_mod, secaggplus_mod]  # the guard sees the unmask request first
    if drills is not None:
        mods.insert(0, _drill_dispatch(drills))
    mods.insert(0, refusal_mod)  # outermost: a refusal is an error reply, not a traceback
    return ClientApp(client_fn=client_fn, mods=mods)


def _drill_dispatch(drills: Callable[[Context], dict[int, str]]) -> Any:
    def mod(msg: Any, ctxt: Context, call_next: Any) -> Any:
        return drill_mod(drills(ctxt))(msg, ctxt, call_next)

    return mod


def server_app(
    settings_of: Callable[[Context], FederatedConfig],
    setup_of: Callable[[Context, FederatedConfig], ServerSetup],
    done: Callable[[Context, FederatedConfig, ServerSetup, ServerState], None],
    report_of: Callable[[Context], Report],
    options_of: Callable[[Context], dict[str, Any]] | None = None,
) -> ServerApp:
    """A ServerApp running :func:`serve`, then ``done`` (publishing) with the final state.
    ``options_of``: keyword arguments for :func:`serve` (the simulation's node order; a test's
    seeded generator). A report with an ``end(status)`` (a tracking run: ``deploy.RunReport``)
    is ended FINISHED after ``done``, KILLED when the run is stopped or interrupted, FAILED on
    any other error."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from nimmer_train.federation.rounds import serve

        settings = settings_of(context)
        setup = setup_of(context, settings)
        options = options_of(context) if options_of else {}
        report = report_of(context)
        status = "FAILED"
        try:
            state = serve(grid, context, settings, setup, report, **options)
            done(context, settings, setup, state)
            status = "FINISHED"
        except (KeyboardInterrupt, SystemExit, RunNotRunningException):
            status = "KILLED"
            raise
        finally:
            end = getattr(report, "end", None)
            if end is not None:
                end(status)

    return app
