"""A Flower grid that hands each message to a ClientApp in this process and returns its reply.

Flower's own server workflows (SecAgg+ included), its client mods and its cryptography run
unchanged; only the transport is left out (no SuperLink, no Ray): each message and each reply
crosses as Flower's protobuf (serialised and parsed, so neither side shares objects with the
other), the apps are called one after the other, and each node keeps its Context (SecAgg+'s keys
and shares) from stage to stage as a SuperNode does. A ClientApp that raises answers with an
error reply, as Flower's runtime makes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.client import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp.grid import Grid
from flwr.supercore.task_identity import TaskIdentity


@contextmanager
def task_identity(run_id: int, node_id: int) -> Iterator[None]:
    """The process's task identity (which a new Message takes its run and source from), as
    Flower's ServerApp and ClientApp runtimes set it; the previous one restored after."""
    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, node_id
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class LoopbackGrid(Grid):
    """Node id -> ClientApp; ``replies`` keeps every reply in the order it was made."""

    def __init__(self, apps: dict[int, ClientApp]) -> None:
        self.apps = apps
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config={}, state=RecordDict(), run_config={})
            for nid in apps
        }
        self._run: Any = SimpleNamespace(run_id=1)
        self.replies: list[Message] = []

    def serving(self) -> Any:
        """The ServerApp's identity, for the server code run against this grid."""
        return task_identity(self._run.run_id, SUPERLINK_NODE_ID)

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError("the workflows build Message objects themselves")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.apps)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        out = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            msg.metadata.__dict__["_run_id"] = self._run.run_id
            nid = msg.metadata.dst_node_id
            received = _crossed(msg)
            try:
                with task_identity(self._run.run_id, nid):
                    reply = _crossed(self.apps[nid](received, self.contexts[nid]))
            except Exception as exc:  # noqa: BLE001 - Flower's runtime turns it into an error reply
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(exc)), reply_to=received)
            self.replies.append(reply)
            out.append(reply)
        return out


def _crossed(msg: Message) -> Message:
    """``msg`` as the other side parses it off the wire."""
    return message_from_proto(message_to_proto(msg))
