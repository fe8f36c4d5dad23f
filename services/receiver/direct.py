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
from typing import Any, cast

from fastapi import FastAPI
from fastapi.dependencies.utils import get_typed_return_annotation
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from starlette._utils import get_route_path
from starlette.convertors import Convertor, PathConvertor, StringConvertor
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send


class _DirectRoute:
    """A webhook route as the direct path runs it: as the app includes it (the include's
    prefix, dependencies and body limit), its pattern and its endpoint."""

    def __init__(self, route: RouteContext) -> None:
        dependant = route.dependant  # the included route's: with the include's dependencies
        params = dependant.path_params
        convertors: dict[str, Convertor[Any]] = route.param_convertors
        if (
            not inspect.iscoroutinefunction(route.endpoint)
            or not _returns_a_response(route.endpoint)
            or dependant.request_param_name != "request"
            # Each of the path's parameters passed as it is, as text, under its own name.
            or {f.name for f in params} != set(convertors)
            or any(f.alias != f.name or f.field_info.annotation is not str for f in params)
            or any(f.field_info.metadata for f in params)  # a length, a pattern, a validator
            or any(type(c) not in (StringConvertor, PathConvertor) for c in convertors.values())
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or dependant.body_params
            or dependant.dependencies
            or route.dependencies
            or dependant.response_param_name
            or dependant.background_tasks_param_name
            or route.max_body_size is not None
        ):
            # FastAPI would parse, validate, inject, limit or serialise these; the direct path does not.
            raise ValueError(
                f"{route.path}: a route served directly is a coroutine taking its path's text "
                "parameters and the request, nothing else, returning a response, under no body limit"
            )
        self.route = route.original_route
        self.template = cast(str, route.path_format)  # an APIRoute's: always there
        self.regex: re.Pattern[str] = route.path_regex
        self.convertors = convertors
        self.endpoint: Callable[..., Awaitable[Response]] = route.endpoint


def _returns_a_response(endpoint: Any) -> bool:
    """A response is sent as it is; anything else FastAPI would serialise."""
    returns = get_typed_return_annotation(endpoint)
    return inspect.isclass(returns) and issubclass(returns, Response)


def _may_answer_first(first: RouteContext, template: str) -> bool:
    """Whether ``first``, which FastAPI tries before the route of this path ``template``,
    could answer a POST to one of its paths. Two path templates share a path only if the
    text before the first parameter of one begins the other's."""
    if isinstance(first.original_route, WebSocketRoute):
        return False
    if first.methods is not None and "POST" not in first.methods:
        return False  # at most a partial match: FastAPI goes on to the route that takes POST
    if first.path_format is None:
        return True  # a Host, or a route of another shape: it may take any path
    ours, theirs = template.split("{", 1)[0], first.path_format.split("{", 1)[0]
    return ours.startswith(theirs) or theirs.startswith(ours)


class ReceiverApp(FastAPI):
    """FastAPI, with the webhook routes given to ``serve_directly`` answered without the
    router and FastAPI's own middleware (see the module's docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct_routes: list[_DirectRoute] = []
        self._direct_stack: ASGIApp | None = None

    def serve_directly(self, routes: Sequence[Any]) -> None:
        """Answer POSTs to these routes directly, as this app includes them. Refuses
        (ValueError) what the direct path would answer otherwise than FastAPI: a route this
        app does not include, one that a route FastAPI tries first may take, one that needs
        FastAPI to parse, validate or limit something (``_DirectRoute``)."""
        if self.max_body_size is not None:
            raise ValueError("the app's max_body_size is FastAPI middleware, which the direct path skips")
        pending = {id(r) for r in routes if isinstance(r, APIRoute) and r.methods == {"POST"}}
        first: list[RouteContext] = []  # the other routes, in the order FastAPI tries them
        for context in iter_route_contexts(self.router.routes):
            if id(context.original_route) not in pending:
                first.append(context)
                continue
            pending.discard(id(context.original_route))
            direct = _DirectRoute(context)
            for other in first:
                if _may_answer_first(other, direct.template):
                    raise ValueError(f"{context.path}: {other.path}, before it, may answer its POSTs")
            self._direct_routes.append(direct)
        if pending:
            raise ValueError("a route served directly must be one this app includes")

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
