"""A SuperNode's ClientApps in one process that stays alive: what ``contrafl-supernode``
starts in place of Flower's ``flower-superexec``.

In flwr 1.41 a SuperNode starts ``flower-superexec``, which asks the SuperNode's runtime
API for ClientApp tasks and starts a new ``flwr-clientapp`` process for each; that
process imports flwr (about 1.3 s of CPU), installs the app bundle, loads the ClientApp,
answers one message and exits. :func:`serve` takes the same arguments as
``flower-superexec`` and does, for each task, what ``flwr-clientapp`` does
(``flwr.supernode.runtime.run_clientapp``: pull the task's message, context, run and
app bundle; install the bundle; load the ClientApp; run it; push its reply, or the
error reply Flower makes of an exception, and the task's status), with flwr's own
functions, in this process, one task at a time. The ClientApp module is imported once.

It is specific to flwr 1.41's runtime API (``flwr>=1.41,<1.42``, as contrafl's
``flower`` extra pins it). Only ClientApp tasks are taken, over the SuperNode's plain
(``--insecure``) runtime API on the same machine; with ``--root-certificates`` (a
SuperNode whose runtime API has its own TLS certificates) ``contrafl-supernode`` keeps
Flower's ``flower-superexec``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from functools import partial
from logging import ERROR

from . import require_flwr

require_flwr()
from flwr.app import Error, Message  # noqa: E402
from flwr.cli.install import install_from_fab  # noqa: E402
from flwr.clientapp.client_app import LoadClientAppError  # noqa: E402
from flwr.clientapp.utils import get_load_client_app_fn  # noqa: E402
from flwr.common.constant import ErrorCode, SubStatus  # noqa: E402
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # noqa: E402  # pylint: disable=E0611
from flwr.supercore import log  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http  # noqa: E402
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor  # noqa: E402
from flwr.supercore.retry import make_simple_http_retry_invoker  # noqa: E402
from flwr.supercore.runtime import RuntimeHttpClient  # noqa: E402
from flwr.supernode.runtime import run_clientapp  # noqa: E402
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output  # noqa: E402

from .lifetime import alive  # noqa: E402
from .supernode import PULL_BACKOFF_S  # noqa: E402

POLL_S = 0.05
"""Seconds between the runner's asks for a new task (flower-superexec's task poll)."""


def client(address: str, *interceptors) -> RuntimeHttpClient:
    """A client of the SuperNode's runtime API at ``address`` (plain HTTP)."""
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=list(interceptors), retry_invoker=make_simple_http_retry_invoker(),
    )


def run_task(address: str, token: str) -> None:
    """The ClientApp task of ``token``, as ``flwr-clientapp`` runs it, in this process."""
    task_client = client(address, RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token))
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(task_client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        message, context, run, fab = pull_task_input(task_client)
        install_from_fab(fab.content, skip_prompt=True)
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        reply = load(run.fab_id, run.fab_version, fab.hash_str)(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # noqa: BLE001 - what flwr-clientapp replies
        code, details = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc)}:<'{exc}'>"
        if isinstance(exc, LoadClientAppError):
            code, details = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "An exception was raised when attempting to load `ClientApp`"
        log(ERROR, "ClientApp raised an exception", exc_info=exc)
        if message is not None:
            reply = Message(Error(code=code, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(task_client, reply, context)
        finally:
            push_task_output(client=task_client, context=context, sub_status=status, details=details)
            heartbeat.stop()
            task_client.close()


def serve(address: str, parent_pid: int | None) -> None:
    """Take the ClientApp tasks of the SuperNode's runtime API at ``address`` and run
    them, one at a time, until the process ``parent_pid`` (the SuperNode) is gone."""
    initial, cap = PULL_BACKOFF_S  # the SuperNode's, for its ClientApps' pulls from it
    run_clientapp.pull_and_inflate_object_from_tree = partial(
        run_clientapp.pull_and_inflate_object_from_tree, initial_backoff=initial, backoff_cap=cap,
    )
    if parent_pid is not None:
        threading.Thread(target=_end_with, args=(parent_pid,), daemon=True).start()
    tasks = client(address, RuntimeVersionHttpInterceptor(component_name="SuperExec"))
    while True:
        acquired = tasks.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        if acquired.HasField("task") and acquired.token:
            run_task(address, acquired.token)
        else:
            time.sleep(POLL_S)


def _end_with(parent_pid: int) -> None:
    """Exit once the process ``parent_pid`` (the SuperNode) is gone, a zombie included
    (flwr's parent monitor takes a killed SuperNode that nobody reaped for alive, and
    its SIGINT can land in a retry that swallows it): a task under way has nobody to
    answer to."""
    while alive(parent_pid):
        time.sleep(0.2)
    os._exit(0)


def main() -> None:
    """``python -m contrafl.flower.runner --runtime-api-address ADDR --insecure [--parent-pid PID]``
    (flower-superexec's arguments, as a SuperNode starts it)."""
    ap = argparse.ArgumentParser(prog="python -m contrafl.flower.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime-api-address", required=True)
    ap.add_argument("--insecure", action="store_true", required=True)
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--allow-runtime-dependency-installation", action="store_true",
                    help="not supported: the runner runs contrafl's ClientApp, installed with contrafl")
    args = ap.parse_args()
    try:
        serve(args.runtime_api_address, args.parent_pid)
    except KeyboardInterrupt:  # the SuperNode is gone (the parent monitor's SIGINT) or was stopped
        pass


if __name__ == "__main__":
    main()
