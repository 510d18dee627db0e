"""tools/sglang_contract.py: ast extraction of SGLang's request classes and routes, and the fixtures.

The extraction is tested on small sources written in each style SGLang has used (a dataclass with
``field(...)`` defaults and a base class, a ``msgspec.Struct``, an ``__init__``-only class, FastAPI
route decorators); the committed fixtures are checked for the routes and fields our client uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.tool_loading import load_tool

contract = load_tool("sglang_contract")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_contract"
VERSIONS = ("0.5.6.post2", "0.5.15.post1", "0.5.21", "0.5.23")

SOURCE = '''
from dataclasses import dataclass, field

@dataclass
class BaseReq:
    rid: Optional[str] = field(default=None, kw_only=True)

@dataclass
class UpdateWeightFromDiskReqInput(BaseReq):
    model_path: str
    flush_cache: bool = True
    tags: List[str] = field(default_factory=list)
    KIND: ClassVar[str] = "disk"

class FlushCacheReqInput(BaseReq, kw_only=True):
    timeout_s: Optional[float] = None

class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, sampling_seed: int = 42) -> None:
        pass

StringOrList = Union[str, List[str]]
'''

ROUTES = '''
@app.api_route("/generate", methods=["POST", "PUT"])
async def generate_request(obj: GenerateReqInput, request: Request):
    pass

@app.get("/health")
async def health(request: Request):
    pass

@app.post("/update_weights_from_disk")
async def update(obj: Annotated[UpdateWeightFromDiskReqInput, Body()], request: Request):
    pass

@app.post(os.environ.get("ROUTE", "/api/chat"))
async def env_route(request: Request):
    pass
'''


def test_extract_classes_follows_bases_and_unwraps_field_defaults():
    names = ("UpdateWeightFromDiskReqInput", "FlushCacheReqInput", "SamplingParams", "Missing")
    out = contract.extract_classes(SOURCE, names, "m.py")
    assert set(out) == {"UpdateWeightFromDiskReqInput", "FlushCacheReqInput", "SamplingParams"}
    disk = out["UpdateWeightFromDiskReqInput"]
    assert disk["kind"] == "@dataclass BaseReq"
    assert disk["fields"] == [
        {"name": "rid", "type": "Optional[str]", "default": "None", "required": False},
        {"name": "model_path", "type": "str", "default": None, "required": True},
        {"name": "flush_cache", "type": "bool", "default": "True", "required": False},
        {"name": "tags", "type": "List[str]", "default": "list()", "required": False},
    ]
    assert [f["name"] for f in out["FlushCacheReqInput"]["fields"]] == ["rid", "timeout_s"]
    assert out["SamplingParams"]["fields"] == [
        {"name": "max_new_tokens", "type": "int", "default": "128", "required": False},
        {"name": "sampling_seed", "type": "int", "default": "42", "required": False},
    ]
    assert contract.extract_aliases(SOURCE) == {"StringOrList": "Union[str, List[str]]"}


def test_extract_routes():
    routes = contract.extract_routes(ROUTES)
    assert routes == {
        "/generate": {"methods": ["POST", "PUT"], "handler": "generate_request", "body": "GenerateReqInput"},
        "/health": {"methods": ["GET"], "handler": "health", "body": None},
        "/update_weights_from_disk": {"methods": ["POST"], "handler": "update",
                                      "body": "UpdateWeightFromDiskReqInput"},
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_fixture_has_every_route_and_class_the_client_uses(version):
    data = json.loads((FIXTURES / f"{version}.json").read_text())
    assert data["sglang_version"] == version
    routes = data["routes"]
    for path, body in [("/generate", "GenerateReqInput"), ("/update_weights_from_disk", "UpdateWeightFromDiskReqInput"),
                       ("/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput"),
                       ("/init_weights_update_group", "InitWeightsUpdateGroupReqInput"),
                       ("/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput"),
                       ("/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput"),
                       ("/release_memory_occupation", "ReleaseMemoryOccupationReqInput"),
                       ("/resume_memory_occupation", "ResumeMemoryOccupationReqInput")]:
        assert routes[path]["body"] == body and "POST" in routes[path]["methods"], path
        assert body in data["classes"], body
    assert routes["/health"]["methods"] == ["GET"] and "GET" in routes["/flush_cache"]["methods"]
    sampling = {f["name"] for f in data["classes"]["SamplingParams"]["fields"]}
    assert {"n", "temperature", "top_p", "top_k", "max_new_tokens", "sampling_seed", "no_stop_trim"} <= sampling
    distributed = {f["name"] for f in data["classes"]["UpdateWeightsFromDistributedReqInput"]["fields"]}
    assert {"names", "dtypes", "shapes", "group_name", "load_format", "flush_cache"} <= distributed
