"""The operator's write API under /v1/operator: start a round, set the merge method, allow or deny
peers, retire checkpoints. Every route needs the operator's bearer token; with none configured
the routes answer 503. The answers' models are skillswarm.protocol.api's, as the read API's."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from skillswarm.coordinator.config import MergePlan
from skillswarm.coordinator.service import Coordinator
from skillswarm.merge.methods import MergeSpec, check_document_shape
from skillswarm.protocol.api import (
    CheckpointOut,
    MergekitYamlBody,
    OperatorError,
    PeerAccessOut,
    RoundOut,
)
from skillswarm.protocol.canonical import MAX_WIRE_INT
from starlette.concurrency import run_in_threadpool

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_MERGE_BODY_BYTES = 64 * 1024
OPERATOR_SCHEME_NAME = "OperatorToken"
JSON_MEDIA_TYPES = ("application/json",)
YAML_MEDIA_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")

operator_bearer = HTTPBearer(
    auto_error=False,
    scheme_name=OPERATOR_SCHEME_NAME,
    description="The operator token, from the environment variable the coordinator config names "
    "(`operator_token_env`, default SKILLSWARM_OPERATOR_TOKEN).",
)


class MergeSpecError(ValueError):
    """A merge specification the coordinator cannot use; the message says what to change."""


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "the request names something malformed",
        401: "no operator token, or the wrong one",
        404: "no checkpoint at that revision",
        409: "the coordinator's state does not allow this now",
        413: "the body is too large",
        415: "the body is neither JSON nor YAML",
        422: "the merge specification is not usable",
        503: "the operator API is disabled: no token is configured",
    }
    return {
        status: {"model": OperatorError, "description": descriptions[status]} for status in statuses
    }


def operator_auth(token: str | None, token_env: str) -> Callable[..., None]:
    """A dependency admitting only requests bearing `token`; with no token, refusing them all."""
    expected = token.encode() if token else None

    def require_operator(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(operator_bearer)],
    ) -> None:
        if expected is None:
            raise HTTPException(503, f"operator API disabled: set ${token_env}")
        offered = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(offered, expected):
            raise HTTPException(
                401,
                "missing or wrong operator token",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_operator


def merge_spec_from_body(body: bytes, content_type: str, yaml_seed: int | None) -> MergeSpec:
    """Parse a PUT /v1/operator/merge body: a MergePlan as JSON, or a mergekit YAML fragment
    (as YAML, or in the JSON field mergekit_yaml) whose seed comes beside it."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in YAML_MEDIA_TYPES:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MergeSpecError(f"the mergekit fragment is not UTF-8: {exc}") from exc
        return MergeSpec.from_mergekit_yaml(text, seed=yaml_seed or 0)
    if media_type not in JSON_MEDIA_TYPES and not media_type.endswith("+json"):
        raise HTTPException(
            415,
            'send application/json (a MergePlan or {"mergekit_yaml": ...}) or '
            f"{YAML_MEDIA_TYPES[0]}, not {media_type or 'a body without content type'}",
        )
    if yaml_seed is not None:
        raise MergeSpecError("the seed query parameter is for YAML bodies; put seed in the JSON")
    try:
        document = check_document_shape(json.loads(body), "the JSON body")
    except ValueError as exc:
        raise MergeSpecError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise MergeSpecError(f"the JSON body nests too deeply to read ({exc})") from exc
    if not isinstance(document, dict):
        raise MergeSpecError("the body must be a JSON object: a MergePlan or {mergekit_yaml}")
    if "mergekit_yaml" in document:
        fragment = _validated(MergekitYamlBody, document)
        return MergeSpec.from_mergekit_yaml(fragment.mergekit_yaml, seed=fragment.seed)
    return _validated(MergePlan, document)


def _validated(model: type[ModelT], document: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors()
        )
        raise MergeSpecError(f"invalid {model.__name__}: {problems}") from exc


async def _read_bounded_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the body exceeds {limit} bytes")
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > limit:
            raise HTTPException(413, f"the body exceeds {limit} bytes")
    return bytes(received)


_MERGE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {"$ref": "#/components/schemas/MergePlan"},
                        MergekitYamlBody.model_json_schema(),
                    ]
                }
            },
            **{
                media_type: {
                    "schema": {"type": "string"},
                    "example": "merge_method: ties\nparameters:\n  weight: 1.0\n  density: 0.5\n",
                }
                for media_type in ("application/yaml", "text/yaml")
            },
        },
    }
}


def operator_router(coordinator: Coordinator, token: str | None, token_env: str) -> APIRouter:
    """The /v1/operator routes acting on `coordinator`, all behind the bearer token `token`."""
    router = APIRouter(
        prefix="/v1/operator",
        tags=["operator"],
        dependencies=[Depends(operator_auth(token, token_env))],
        responses=_errors(401, 503),
    )

    @router.post(
        "/rounds",
        response_model=RoundOut,
        responses=_errors(409),
        summary="Merge the current round now, whatever its policy says",
        description="Runs the merge, evaluation and publication before answering; the round's "
        "record comes back published, or failed with its error. 409 when the round has no "
        "accepted delta or a merge is already running.",
    )
    def start_round() -> RoundOut:
        try:
            merged = coordinator.request_round()
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from exc
        return RoundOut.model_validate(merged)

    @router.put(
        "/merge",
        response_model=MergePlan,
        responses=_errors(413, 415, 422),
        openapi_extra=_MERGE_BODY_DOC,
        summary="Set the merge method, its parameters, dtype and seed for the next merges",
        description="A MergePlan (a MergeSpec, optionally with candidates) as JSON, or a "
        "mergekit fragment (merge_method, top-level parameters, dtype, out_dtype) as YAML or in "
        "the JSON field mergekit_yaml. It replaces the configured plan, candidates included.",
    )
    async def set_merge(
        request: Request,
        seed: Annotated[
            int | None,
            Query(
                ge=0,
                le=MAX_WIRE_INT,
                description="RNG seed for a YAML body (JSON bodies carry their own)",
            ),
        ] = None,
    ) -> MergePlan:
        body = await _read_bounded_body(request, MAX_MERGE_BODY_BYTES)
        content_type = request.headers.get("content-type", "")

        def parse_and_apply() -> MergePlan:
            coordinator.set_merge_spec(merge_spec_from_body(body, content_type, seed))
            return coordinator.config.merge

        try:
            return await run_in_threadpool(parse_and_apply)
        except ValueError as exc:  # MergeSpecError, or the coordinator refusing the spec
            raise HTTPException(422, str(exc)) from exc

    def set_access(peer_id: str, allowed: bool) -> PeerAccessOut:
        try:
            coordinator.set_peer_allowed(peer_id, allowed)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        return PeerAccessOut(peer_id=peer_id, allowed=allowed)

    @router.post(
        "/peers/{peer_id}/allow",
        response_model=PeerAccessOut,
        responses=_errors(400),
        summary="Admit this peer's deltas",
    )
    def allow_peer(peer_id: str) -> PeerAccessOut:
        return set_access(peer_id, True)

    @router.post(
        "/peers/{peer_id}/deny",
        response_model=PeerAccessOut,
        responses=_errors(400),
        summary="Refuse this peer's deltas from now on",
    )
    def deny_peer(peer_id: str) -> PeerAccessOut:
        return set_access(peer_id, False)

    @router.post(
        "/checkpoints/{revision}/retire",
        response_model=CheckpointOut,
        responses=_errors(404, 409),
        summary="Take a checkpoint out of service: never main again, no longer served",
    )
    def retire_checkpoint(revision: str) -> CheckpointOut:
        try:
            retired = coordinator.retire_checkpoint(revision)
        except KeyError as exc:
            raise HTTPException(404, f"no checkpoint at revision {revision}") from exc
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from exc
        return CheckpointOut.model_validate(retired)

    return router
