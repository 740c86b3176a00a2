"""The build every language's image shares: pruning, against an in-process stand-in for the engine's image
API (no engine, and so no other checkout's images, is touched here; tests/sandbox/test_image.py prunes a
repository of its own on the real engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import docker
import docker.errors
import requests

from metaagent.languages.javascript.image import IMAGE_REPOSITORY, image_tag, prune_images
from metaagent.languages.python.image import PYTHON_IMAGE_REPOSITORY, prune_python_images, python_image_tag
from metaagent.languages.rootfs import IMAGE_LABEL, prune_repository


@dataclass
class FakeImage:
    tags: list[str]
    labelled: bool = True


@dataclass
class FakeImages:
    """`client.images` as prune uses it: list by label, remove by tag (409 for a tag a container uses)."""

    images: list[FakeImage]
    in_use: frozenset[str] = frozenset()
    removed: list[str] = field(default_factory=list)

    def list(self, filters: dict[str, str]) -> list[FakeImage]:
        assert filters == {"label": IMAGE_LABEL}
        return [image for image in self.images if image.labelled]

    def remove(self, tag: str) -> None:
        if tag in self.in_use:
            response = requests.Response()
            response.status_code = 409
            raise docker.errors.APIError("conflict: the image is used by a container", response=response)
        self.removed.append(tag)


@dataclass
class FakeClient:
    images: FakeImages


def engine_with(*images: FakeImage, in_use: frozenset[str] = frozenset()) -> tuple[docker.DockerClient, FakeImages]:
    fake = FakeImages(list(images), in_use)
    return cast(docker.DockerClient, FakeClient(fake)), fake


def every_languages_tags() -> list[FakeImage]:
    """This version's and another version's tag of each language's image, a neighbouring repository and an
    unlabelled image that merely shares the name."""
    return [
        FakeImage([image_tag(), f"{IMAGE_REPOSITORY}:0.0.0-old"]),
        FakeImage([python_image_tag(), f"{PYTHON_IMAGE_REPOSITORY}:0.0.0-old"]),
        FakeImage([f"{IMAGE_REPOSITORY}-other:0.0.0-old"]),
        FakeImage([f"{IMAGE_REPOSITORY}:0.0.0-unlabelled"], labelled=False),
    ]


def test_prune_repository_removes_only_the_repositorys_other_tags_and_reports_those_in_use() -> None:
    client, fake = engine_with(
        FakeImage(["mine:current", "mine:old", "mine-too:old"]),
        FakeImage(["mine:used", "theirs:old"]),
        in_use=frozenset({"mine:used"}),
    )
    assert prune_repository(client, "mine", "mine:current") == (["mine:old"], ["mine:used"])
    assert fake.removed == ["mine:old"]


def test_javascript_prune_removes_only_other_javascript_tags() -> None:
    client, fake = engine_with(*every_languages_tags())
    assert prune_images(client) == ([f"{IMAGE_REPOSITORY}:0.0.0-old"], [])
    assert fake.removed == [f"{IMAGE_REPOSITORY}:0.0.0-old"]


def test_python_prune_removes_only_other_python_tags() -> None:
    client, fake = engine_with(*every_languages_tags())
    assert prune_python_images(client) == ([f"{PYTHON_IMAGE_REPOSITORY}:0.0.0-old"], [])
    assert fake.removed == [f"{PYTHON_IMAGE_REPOSITORY}:0.0.0-old"]
