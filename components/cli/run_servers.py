"""The `sao` commands that serve an endpoint until interrupted: the programmatic teacher and the embedded rollout
engine. Each binds its port once before it loads anything, so a port in use is one `sao:` line."""

from __future__ import annotations

import argparse

import torch

from components.cli.checks import check_port
from components.cli.prepare import prepare
from components.data.solver_server import serve_solver
from components.rollout.access import Access, check_bind
from components.rollout.server import serve


def teacher_serve(args: argparse.Namespace) -> None:
    check_port(args.host, args.port)
    serve_solver(args.host, args.port, args.mental_max, args.mental_frac)


def engine_serve(args: argparse.Namespace) -> None:
    prepare(args)  # the config and home are checked as for every command that takes them
    access = Access.from_environment(args.publish_root)
    check_bind(args.host, access)
    check_port(args.host, args.port)
    serve(args.model, args.host, args.port, args.max_batch, args.threads, access, getattr(torch, args.dtype))
