"""The webhooks served without FastAPI's request machinery.

A webhook is the receiver's hot path: every buyer message is one, and under load the
framework around the handler (FastAPI's telemetry hooks and body-limit layer, the router
walking every admin route, dependency solving, the per-request exit stacks) cost more CPU
than the handler and its Postgres write together. ``ReceiverApp`` answers a POST to a
webhook route itself: it matches the route with the route's own pattern, and runs the
route's own endpoint inside the same middleware that FastAPI would have run it in (the
500 handler, the app's own middleware such as the body cap, the exception handlers that
turn errors into JSON). Everything else, and any other method on those paths, goes to
FastAPI unchanged; the routes stay registered there, so the OpenAPI document is the same.

What a webhook request does not go through: FastAPI's native OpenTelemetry (the receiver
configures no OpenTelemetry SDK, so it records nothing either way), its body-size limit
(unset: the app's own ``BodySizeLimit`` runs instead, as before) and its exit stacks
(no webhook endpoint has dependencies)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.convertors import Convertor
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send


class _DirectRoute:
    """A webhook route as the direct path runs it: its own pattern and endpoint."""

    def __init__(self, route: APIRoute) -> None:
        dependant = route.dependant
        takes = {f.name: f.field_info.annotation for f in dependant.path_params}
        if (
            not inspect.iscoroutinefunction(route.endpoint)
            or dependant.request_param_name != "request"
            or any(t is not str for t in takes.values())
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or dependant.body_params
            or dependant.dependencies
            or route.dependencies
            or dependant.response_param_name
            or dependant.background_tasks_param_name
        ):
            # FastAPI would parse, validate or inject these; the direct path does not.
            raise ValueError(
                f"{route.path}: a route served directly is a coroutine taking its path's text "
                "parameters and the request, nothing else"
            )
        self.route = route
        self.regex: re.Pattern[str] = route.path_regex
        self.convertors: dict[str, Convertor[Any]] = route.param_convertors
        self.endpoint: Callable[..., Awaitable[Response]] = route.endpoint


class ReceiverApp(FastAPI):
    """FastAPI, with the webhook routes given to ``serve_directly`` answered without the
    router and FastAPI's own middleware (see the module's docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct_routes: list[_DirectRoute] = []
        self._direct_stack: ASGIApp | None = None

    def serve_directly(self, routes: Sequence[Any]) -> None:
        """Answer POSTs to these routes directly: routes this app includes without a
        prefix, that no route included before them takes."""
        for route in routes:
            if isinstance(route, APIRoute) and route.methods == {"POST"}:
                self._direct_routes.append(_DirectRoute(route))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self._direct_routes:
            if self.root_path:
                scope["root_path"] = self.root_path  # as FastAPI does, before the route is matched
            # The router's own reading of the path (root_path taken off).
            path = get_route_path(scope)
            for direct in self._direct_routes:
                match = direct.regex.match(path)
                if match is not None:
                    params = {k: direct.convertors[k].convert(v) for k, v in match.groupdict().items()}
                    scope["app"] = self
                    scope["path_params"] = params
                    scope["route"] = direct.route
                    scope["endpoint"] = direct.endpoint
                    if self._direct_stack is None:
                        self._direct_stack = self._build_direct_stack()
                    await self._direct_stack(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    def _build_direct_stack(self) -> ASGIApp:
        """FastAPI's middleware stack (``build_middleware_stack``) less what a webhook
        does not use; the same order, the same handlers."""
        if self.middleware_stack is None:
            # FastAPI's own, built now from the same middleware and handlers: once it has
            # answered a webhook the app has started, and refuses ``add_middleware`` (else
            # what is added later would run on every request but the webhooks).
            self.middleware_stack = self.build_middleware_stack()
        error_handler = None
        handlers: dict[Any, Any] = {}
        for key, value in self.exception_handlers.items():
            if key in (500, Exception):
                error_handler = value
            else:
                handlers[key] = value
        middleware = [
            Middleware(ServerErrorMiddleware, handler=error_handler, debug=self.debug),
            *self.user_middleware,
            Middleware(ExceptionMiddleware, handlers=handlers, debug=self.debug),
        ]
        app: ASGIApp = _run_endpoint
        for cls, args, kwargs in reversed(middleware):
            app = cls(app, *args, **kwargs)
        return app


async def _run_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive, send)
    response = await scope["endpoint"](request=request, **scope["path_params"])
    await response(scope, receive, send)
