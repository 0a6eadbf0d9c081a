"""Reliability: broken plugins fail alone, loudly, naming their distribution, version and family.

Every plugin here is a real distribution: a ``<name>-<version>.dist-info`` directory (``METADATA``,
``entry_points.txt`` in the ``fusion_core`` group) plus its module, in a temporary directory put on
``sys.path``, so ``importlib.metadata`` finds it exactly as it finds a pip-installed plugin.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from fusion_patch_embeddings.family import PatchLinearMixin
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core import cli
from fusion_core.patching import installed_classes
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

QWEN = auto_class(TINY_MODELS["qwen2_vl"])
PATCH = {"patch_embeddings": True}


class Site:
    """A directory on ``sys.path`` holding throwaway plugin distributions."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prefix = f"relplug_{uuid.uuid4().hex[:8]}_"
        self.modules: list[str] = []

    def add(self, dist: str, version: str, plugins: dict[str, str], modules: dict[str, str],
            group: str = "fusion_core") -> dict[str, str]:
        """Write a distribution with entry points in ``group``; module names get a unique prefix. Returns the real
        module names."""
        names = {short: self.prefix + dist.replace("-", "_") + "_" + short for short in modules}
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = [f"{ep} = {_rename(target, names)}\n" for ep, target in plugins.items()]
        (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(lines))
        for short, source in modules.items():
            (self.root / f"{names[short]}.py").write_text(textwrap.dedent(source))
        self.modules.extend(names.values())
        fusion_core.reset_registry()
        return names

    def family(self, dist: str, name: str, version: str = "0.3.1", body: str = "", register: str | None = None,
               group: str = "fusion_core", entry_point: str | None = None) -> None:
        """A one-family plugin distribution; ``body`` overrides parts of a working family."""
        source = FAMILY_TEMPLATE.format(name=name, body=textwrap.indent(textwrap.dedent(body), "    "))
        source += textwrap.dedent(register or "\n@fusion_core.hookimpl\ndef register_fusion_families(register):\n"
                                              "    register(Family())\n")
        self.add(dist, version, {entry_point or name: "plugin"}, {"plugin": source}, group)


FAMILY_TEMPLATE = '''\
import fusion_core
import torch
from torch import nn
from fusion_core import Flatten, FusionFamily, TransformOp, WeightTransform
from fusion_patch_embeddings.family import PatchLinearMixin, is_non_overlapping_conv3d


class Family(FusionFamily):
    """A family built to fail in one way."""

    name = "{name}"

    def is_fusable(self, module, options):
        return is_non_overlapping_conv3d(module)

    def make_fused_class(self, original_cls, options):
        return type(original_cls.__name__, (PatchLinearMixin, original_cls), {{}})

    def make_transforms(self, config, options):
        return [WeightTransform(("weight",), ("weight",), Flatten(start_dim=1))]
{body}
'''


def _rename(target: str, names: dict[str, str]) -> str:
    module, sep, attr = target.partition(":")
    return names.get(module, module) + sep + attr


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site-packages"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    result = Site(root)
    yield result
    for name in result.modules:
        sys.modules.pop(name, None)
    fusion_core.reset_registry()


@pytest.fixture
def qwen_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2_vl")[0]


def _patch_embeddings_still_works(directory: Path) -> None:
    model = fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH)
    assert isinstance(model.model.visual.patch_embed.proj, PatchLinearMixin)
    assert installed_classes() == []


def _failures_text() -> str:
    return "\n".join(str(f) for f in fusion_core.get_registry().failures)


# -- faults while the registry collects families -------------------------------------------------------

_HOOK = "\n@fusion_core.hookimpl\ndef register_fusion_families(register):\n"
_GOOD_FAMILY = FAMILY_TEMPLATE.format(name="{name}", body="")

# (case id, plugin module source (a "{name}" placeholder is the family/entry-point name), text the report contains)
REGISTRATION_FAULTS: list[tuple[str, str, str]] = [
    ("import-error", "import fusion_core\nimport torchfoo_does_not_exist\n", "ModuleNotFoundError"),
    ("import-raises", "raise ImportError('needs CUDA 99')\n", "needs CUDA 99"),
    ("syntax-error", "def broken(:\n", "SyntaxError"),
    ("exit-on-import", "import sys\nsys.exit(3)\n", "SystemExit"),
    ("no-hook", "import fusion_core\nX = 1\n", "implements no fusion_core hook"),
    ("wrong-hook-signature", "import fusion_core\n@fusion_core.hookimpl\ndef register_fusion_families(registry):\n"
                             "    pass\n", "invalid hook implementation"),
    ("misspelled-hook", _GOOD_FAMILY + _HOOK + "    register(Family())\n\n@fusion_core.hookimpl\n"
                        "def fusion_modul_fused(module, plan):\n    pass\n",
     "implements hooks fusion_core does not define: 'fusion_modul_fused' (did you mean 'fusion_module_fused'?)"),
    ("hook-raises", "import fusion_core" + _HOOK + "    raise RuntimeError('boom in hook')\n", "boom in hook"),
    ("hook-exits", "import fusion_core, sys" + _HOOK + "    sys.exit(1)\n", "SystemExit"),
    ("hook-returns-specs", _GOOD_FAMILY + _HOOK + "    return [Family()]\n",
     "must call register(...) and return None"),
    ("registers-object", "import fusion_core" + _HOOK + "    register(object())\n", "is not a ModuleFusionSpec"),
    ("registers-string", "import fusion_core" + _HOOK + "    register('{name}')\n", "is not a ModuleFusionSpec"),
    ("registers-none", "import fusion_core" + _HOOK + "    register(None)\n", "is not a ModuleFusionSpec"),
    ("registers-class", _GOOD_FAMILY + _HOOK + "    register(Family)\n", "not the class itself"),
    ("missing-method", "import fusion_core\nclass Family:\n    name = '{name}'\n    description = ''\n"
                       + _HOOK + "    register(Family())\n", "missing: options_model"),
    ("invalid-name", _GOOD_FAMILY.replace('name = "{name}"', 'name = "{name}-x"') + _HOOK + "    register(Family())\n",
     "is not an identifier"),
    ("invalid-regex", _GOOD_FAMILY.replace('"""A family built to fail in one way."""',
                                           'target_modules_patterns = ("proj(",)') + _HOOK + "    register(Family())\n",
     "invalid target_modules_patterns entry 'proj('"),
    ("patterns-as-str", _GOOD_FAMILY.replace('"""A family built to fail in one way."""',
                                             'target_modules_patterns = "proj"') + _HOOK + "    register(Family())\n",
     "not a str"),
    ("options-not-familyoptions", "from pydantic import BaseModel\n" + _GOOD_FAMILY.replace(
        '"""A family built to fail in one way."""', 'options_model = BaseModel') + _HOOK + "    register(Family())\n",
     "must subclass fusion_core.FamilyOptions"),
    ("options-allow-extra", "from pydantic import ConfigDict\n" + _GOOD_FAMILY.replace(
        '"""A family built to fail in one way."""',
        'class options_model(fusion_core.FamilyOptions):\n        model_config = ConfigDict(extra="allow")'
    ) + _HOOK + "    register(Family())\n", "keep extra='forbid'"),
    ("description-not-str", _GOOD_FAMILY.replace('"""A family built to fail in one way."""', "description = 3")
     + _HOOK + "    register(Family())\n", "description must be a string"),
    ("misspelt-optional-member", _GOOD_FAMILY.replace(
        '"""A family built to fail in one way."""',
        "def module_transform(self, module, config, options):\n        return None",
    ) + _HOOK + "    register(Family())\n",
     "family 'brokenfam': 'module_transform' is not a ModuleFusionSpec member (did you mean 'module_transforms'?)"),
    ("entry-point-attribute-missing", "import fusion_core\n", "has no attribute"),
]


@pytest.mark.parametrize(
    ("source", "text"),
    [c[1:] for c in REGISTRATION_FAULTS], ids=[c[0] for c in REGISTRATION_FAULTS])
def test_broken_plugin_is_reported_with_its_distribution_and_others_keep_working(source, text, site, qwen_dir):
    name = "brokenfam"
    target = "plugin:missing_attribute" if text == "has no attribute" else "plugin"
    site.add("fusion-broken-thing", "2.7.1", {name: target}, {"plugin": source.replace("{name}", name)})
    registry = fusion_core.get_registry()  # must not raise (not strict), must not exit
    assert name not in registry
    report = _failures_text()
    assert "fusion-broken-thing 2.7.1" in report and f"plugin {name!r}" in report and text in report, report
    # asking for the family names the distribution that failed to provide it
    with pytest.raises(ValidationError) as info:
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={name: True})
    assert "fusion-broken-thing 2.7.1" in str(info.value)
    _patch_embeddings_still_works(qwen_dir)


@pytest.mark.parametrize(
    ("source", "text"),
    [c[1:] for c in REGISTRATION_FAULTS], ids=[c[0] for c in REGISTRATION_FAULTS])
def test_strict_mode_turns_the_report_into_an_error(source, text, site, monkeypatch):
    name = "brokenfam"
    target = "plugin:missing_attribute" if text == "has no attribute" else "plugin"
    site.add("fusion-broken-thing", "2.7.1", {name: target}, {"plugin": source.replace("{name}", name)})
    monkeypatch.setenv("FUSION_CORE_STRICT_PLUGINS", "1")
    fusion_core.reset_registry()
    with pytest.raises(fusion_core.PluginError, match=r"(?s)fusion-broken-thing 2\.7\.1.*FUSION_CORE_STRICT_PLUGINS=1"):
        fusion_core.get_registry()


def test_one_bad_family_does_not_take_down_its_siblings(site, qwen_dir):
    source = _GOOD_FAMILY.replace("{name}", "goodfam") + _HOOK + "    register(object())\n    register(Family())\n"
    site.add("fusion-mixed", "1.0", {"mixed": "plugin"}, {"plugin": source})
    registry = fusion_core.get_registry()
    assert "goodfam" in registry and "patch_embeddings" in registry
    assert "fusion-mixed 1.0" in _failures_text()
    model = fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={"goodfam": True})
    assert isinstance(model.model.visual.patch_embed.proj, PatchLinearMixin)


def test_duplicate_family_names_disable_the_name_and_name_both_distributions(site, qwen_dir):
    for dist, version in (("fusion-dup-a", "1.0"), ("fusion-dup-b", "2.0")):
        site.family(dist, "dupfam", version=version)
    registry = fusion_core.get_registry()
    assert "dupfam" not in registry and "patch_embeddings" in registry
    with pytest.raises(ValidationError) as info:
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={"dupfam": True})
    message = str(info.value)
    assert "fusion-dup-a 1.0" in message and "fusion-dup-b 2.0" in message
    _patch_embeddings_still_works(qwen_dir)


def test_a_plugin_claiming_a_shipped_family_name_never_replaces_it(site, qwen_dir):
    """Entry-point order must not decide which 'patch_embeddings' runs, and the core keeps no list of
    who owns which name: the name is disabled, both claimants are reported naming each other."""
    site.family("aaa-squatter", "patch_embeddings", version="9.9")
    registry = fusion_core.get_registry()
    assert "patch_embeddings" not in registry
    text = _failures_text()
    assert "aaa-squatter 9.9" in text and "fusion-patch-embeddings" in text and "patch_embeddings" in text
    with pytest.raises(ValidationError, match=r"(?s)aaa-squatter 9\.9.*FUSION_CORE_ALLOWED_PLUGINS"):
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config=PATCH)


def test_allow_list_keeps_the_squatter_out(site, qwen_dir, monkeypatch):
    site.family("aaa-squatter", "patch_embeddings", version="9.9")
    monkeypatch.setenv("FUSION_CORE_ALLOWED_PLUGINS", "fusion-patch-embeddings")
    fusion_core.reset_registry()
    assert fusion_core.get_registry().get("patch_embeddings").source.distribution == "fusion-patch-embeddings"
    _patch_embeddings_still_works(qwen_dir)


# -- faults of a registered family, met when it is used -----------------------------------------------------

# (case id, class body overriding the working family, error type, text the error contains)
USE_FAULTS: list[tuple[str, str, type, str]] = [
    ("is-fusable-raises", "def is_fusable(self, module, options):\n    raise KeyError('no such attr')\n",
     fusion_core.DiscoveryError, "is_fusable raised KeyError on module"),
    ("is-fusable-not-bool", "def is_fusable(self, module, options):\n    return 'yes'\n",
     fusion_core.DiscoveryError, "is_fusable must return a bool"),
    ("nothing-fusable", "def is_fusable(self, module, options):\n    return False\n",
     fusion_core.DiscoveryError, "found nothing to fuse"),
    ("nothing-fusable-says-why", "def is_fusable(self, module, options):\n    return False\n"
     "def refusal(self, module, options):\n    return 'a made-up reason' if isinstance(module, nn.Conv3d) else None\n",
     fusion_core.DiscoveryError, "1 declined, e.g. model.visual.patch_embed.proj: a made-up reason"),
    ("refusal-raises", "def is_fusable(self, module, options):\n    return False\n"
     "def refusal(self, module, options):\n    raise KeyError('no reason')\n",
     fusion_core.DiscoveryError, "refusal raised KeyError on module"),
    ("refusal-not-str", "def is_fusable(self, module, options):\n    return False\n"
     "def refusal(self, module, options):\n    return 3\n",
     fusion_core.DiscoveryError, "refusal must return a str or None, got 3"),
    ("make-fused-class-raises", "def make_fused_class(self, cls, options):\n    raise RuntimeError('no class')\n",
     fusion_core.DiscoveryError, "make_fused_class(Conv3d) raised RuntimeError"),
    ("fused-class-not-subclass", "def make_fused_class(self, cls, options):\n    return nn.Linear\n",
     fusion_core.DiscoveryError, "must return a subclass of it"),
    ("fused-class-not-a-class", "def make_fused_class(self, cls, options):\n    return 'Linear'\n",
     fusion_core.DiscoveryError, "must return a subclass of it"),
    ("fused-class-defines-init", "def make_fused_class(self, cls, options):\n"
     "    return type(cls.__name__, (cls,), {'__init__': lambda self, *a, **k: None})\n",
     fusion_core.DiscoveryError, "defines __init__"),
    ("finalize-raises", "def make_fused_class(self, cls, options):\n    def fusion_finalize(self):\n"
     "        raise ValueError('cannot finalize')\n"
     "    return type(cls.__name__, (PatchLinearMixin, cls), {'fusion_finalize': fusion_finalize})\n",
     fusion_core.DiscoveryError, "failed on the meta device: ValueError: cannot finalize"),
    ("finalize-raises-on-real-data", "def make_fused_class(self, cls, options):\n    def fusion_finalize(self):\n"
     "        if not self.weight.is_meta:\n            raise ValueError('real data refused')\n"
     "    return type(cls.__name__, (PatchLinearMixin, cls), {'fusion_finalize': fusion_finalize})\n",
     fusion_core.FusionLoadError, "real data refused"),
    ("make-transforms-raises", "def make_transforms(self, config, options):\n    return config.no_such_attr\n",
     fusion_core.DiscoveryError, "make_transforms raised AttributeError"),
    ("make-transforms-garbage", "def make_transforms(self, config, options):\n    return ['weight']\n",
     fusion_core.DiscoveryError, "not a WeightTransform"),
    ("transform-missing-leaf", "def make_transforms(self, config, options):\n"
     "    return [WeightTransform(('weights',), ('weight',), Flatten(1))]\n",
     fusion_core.PlanError, "needs tensor(s) ['weights']"),
    ("transform-bad-shapes", "def make_transforms(self, config, options):\n"
     "    return [WeightTransform(('weight',), ('weight',), Flatten(7))]\n",
     fusion_core.PlanError, "Flatten rejects shapes"),
    ("transform-consumes-twice", "def make_transforms(self, config, options):\n"
     "    return [WeightTransform(('weight',), ('a',), Flatten(1)), WeightTransform(('weight',), ('b',))]\n",
     fusion_core.PlanError, "consumed by two transforms"),
    ("op-lies-about-shapes", "def make_transforms(self, config, options):\n"
     "    class Liar(Flatten):\n        def forward(self, tensors):\n            return (tensors[0].flatten(),)\n"
     "    return [WeightTransform(('weight',), ('weight',), Liar(1))]\n",
     fusion_core.DiscoveryError, "it declared"),
    ("inverse-wrong-shape", "def make_transforms(self, config, options):\n"
     "    class OneWay(Flatten):\n        def inverse(self, tensors, source_shapes):\n"
     "            return (tensors[0],)\n"
     "    return [WeightTransform(('weight',), ('weight',), OneWay(1))]\n",
     fusion_core.DiscoveryError, "is not invertible"),
    ("inverse-loses-data", "def make_transforms(self, config, options):\n"
     "    class Lossy(Flatten):\n        def inverse(self, tensors, source_shapes):\n"
     "            return (torch.zeros(source_shapes[0], dtype=tensors[0].dtype, device=tensors[0].device),)\n"
     "    return [WeightTransform(('weight',), ('weight',), Lossy(1))]\n",
     fusion_core.FusionLoadError, "is not invertible: its inverse does not restore tensor"),
    ("inverse-raises", "def make_transforms(self, config, options):\n"
     "    class NoWayBack(Flatten):\n        def inverse(self, tensors, source_shapes):\n"
     "            raise NotImplementedError('one way only')\n"
     "    return [WeightTransform(('weight',), ('weight',), NoWayBack(1))]\n",
     fusion_core.DiscoveryError, "one way only"),
]


@pytest.mark.parametrize(("body", "error", "text"), [c[1:] for c in USE_FAULTS], ids=[c[0] for c in USE_FAULTS])
def test_broken_family_fails_its_load_naming_distribution_version_and_family(body, error, text, site, qwen_dir):
    site.family("fusion-faulty", "faultyfam", version="0.3.1", body=body)
    assert "faultyfam" in fusion_core.get_registry()
    with pytest.raises(error) as info:
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={"faultyfam": True})
    message = str(info.value)
    assert text in message, message
    assert "'faultyfam'" in message and "fusion-faulty 0.3.1" in message, message
    assert installed_classes() == []
    _patch_embeddings_still_works(qwen_dir)


def test_the_working_template_family_loads(site, qwen_dir):
    """Control for the cases above: without a fault the template family fuses and round-trips."""
    site.family("fusion-faulty", "faultyfam", version="0.3.1")
    model = fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={"faultyfam": True})
    assert isinstance(model.model.visual.patch_embed.proj, PatchLinearMixin)


# -- trust: what gets imported at all ---------------------------------------------------------------------

_MARKER_PLUGIN = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported")
""" + _GOOD_FAMILY.replace("{name}", "markerfam") + _HOOK + "    register(Family())\n"


def _marker_plugin(marker: Path) -> dict[str, str]:
    """A plugin module that leaves a file behind when it is imported."""
    return {"plugin": _MARKER_PLUGIN.replace("{marker!r}", repr(str(marker)))}


def test_disable_autoload_imports_no_plugin_at_all(site, tmp_path, monkeypatch, qwen_dir):
    marker = tmp_path / "imported"
    site.add("fusion-marker", "1.0", {"markerfam": "plugin"}, _marker_plugin(marker))
    monkeypatch.setenv("FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    fusion_core.reset_registry()
    registry = fusion_core.get_registry()
    assert registry.names() == [] and registry.failures == []
    assert not marker.exists()
    with pytest.raises(ValidationError, match=r"installed distribution fusion-patch-embeddings .* not loaded "
                                              r"\(FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD=1\)"):
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config=PATCH)
    # families can still be registered by hand
    from fusion_patch_embeddings import PatchEmbeddingsFamily

    fusion_core.register_family(PatchEmbeddingsFamily())
    _patch_embeddings_still_works(qwen_dir)


@pytest.mark.parametrize(
    "allowed", ["fusion-patch-embeddings", "Fusion_Patch.Embeddings", " fusion-patch-embeddings ,x"]
)
def test_allow_list_never_imports_other_distributions(allowed, site, tmp_path, monkeypatch, qwen_dir):
    marker = tmp_path / "imported"
    site.add("fusion-marker", "1.0", {"markerfam": "plugin"}, _marker_plugin(marker))
    monkeypatch.setenv("FUSION_CORE_ALLOWED_PLUGINS", allowed)
    fusion_core.reset_registry()
    registry = fusion_core.get_registry()
    assert "markerfam" not in registry and "patch_embeddings" in registry
    assert not marker.exists()
    assert "fusion-marker 1.0" in _failures_text() and "FUSION_CORE_ALLOWED_PLUGINS" in _failures_text()
    _patch_embeddings_still_works(qwen_dir)


def test_allow_list_admits_what_it_names(site, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    site.add("fusion-marker", "1.0", {"markerfam": "plugin"}, _marker_plugin(marker))
    monkeypatch.setenv("FUSION_CORE_ALLOWED_PLUGINS", "fusion-marker")
    fusion_core.reset_registry()
    registry = fusion_core.get_registry()
    assert "markerfam" in registry and "patch_embeddings" not in registry and marker.exists()


def test_fusion_list_json_shows_active_and_failed_plugins_with_their_distribution(site, capsys):
    site.add("fusion-broken-thing", "2.7.1", {"brokenfam": "plugin"}, {"plugin": "raise ImportError('nope')\n"})
    site.family("fusion-faulty", "faultyfam", version="0.3.1")
    assert cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    active = {f["name"]: f for f in data["families"]}
    assert active["patch_embeddings"]["distribution"] == "fusion-patch-embeddings"
    assert (active["faultyfam"]["distribution"], active["faultyfam"]["version"]) == ("fusion-faulty", "0.3.1")
    failed = [f for f in data["failed_plugins"] if f["distribution"] == "fusion-broken-thing"]
    assert failed and failed[0]["version"] == "2.7.1" and failed[0]["plugin"] == "brokenfam"
    assert "ImportError: nope" in failed[0]["reason"]
    assert cli.main(["list"]) == 0
    text = capsys.readouterr().out
    assert "fusion-faulty" in text and "fusion-broken-thing" in text


def test_plugin_registry_is_usable_on_every_model_after_failures(site, qwen_dir):
    """A failing load of a broken family leaves nothing behind: a later plain load is plain."""
    site.family("fusion-faulty", "faultyfam", body=USE_FAULTS[-1][1])
    with pytest.raises(fusion_core.DiscoveryError):
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={"faultyfam": True})
    plain = QWEN.from_pretrained(qwen_dir)
    assert type(plain.model.visual.patch_embed.proj) is torch.nn.Conv3d


@pytest.mark.parametrize("squatter_first", [True, False])
def test_a_clashing_family_name_is_disabled_in_either_load_order(squatter_first):
    import types

    from fusion_patch_embeddings import PatchEmbeddingsFamily

    from fusion_core.plugins import FamilyRegistry, PluginSource

    def plugin() -> types.SimpleNamespace:
        return types.SimpleNamespace(
            register_fusion_families=fusion_core.hookimpl(lambda register: register(PatchEmbeddingsFamily()))
        )

    registry = FamilyRegistry()
    squatter = (plugin(), PluginSource("patch_embeddings", "evil-dist", "6.6"))
    known = (plugin(), PluginSource("patch_embeddings", "fusion-patch-embeddings", "0.1.0"))
    for obj, source in [squatter, known] if squatter_first else [known, squatter]:
        registry.register_plugin(obj, source=source)
    assert "patch_embeddings" not in registry
    assert {f.source.distribution for f in registry.failures} == {"evil-dist", "fusion-patch-embeddings"}
    assert all("evil-dist" in str(f) and "fusion-patch-embeddings" in str(f) for f in registry.failures)
    with pytest.raises(fusion_core.PluginError, match="disabled"):  # nor can it be taken by hand afterwards
        registry.register_family(PatchEmbeddingsFamily())


def test_a_plugin_registering_one_name_twice_disables_it_and_says_so():
    import types

    from fusion_patch_embeddings import PatchEmbeddingsFamily

    from fusion_core.plugins import FamilyRegistry, PluginSource

    def hook(register):
        register(PatchEmbeddingsFamily())
        register(PatchEmbeddingsFamily())

    registry = FamilyRegistry()
    plugin = types.SimpleNamespace(register_fusion_families=fusion_core.hookimpl(hook))
    registry.register_plugin(plugin, source=PluginSource("twice", "fusion-twice", "1.0"))
    assert "patch_embeddings" not in registry
    assert [str(f) for f in registry.failures] == [
        "family 'patch_embeddings' of plugin 'twice' from distribution fusion-twice 1.0: registers family name "
        "'patch_embeddings' twice; the family is disabled"
    ]


# -- misspelt members of a family spec ------------------------------------------------------------------


def _family_class(**attributes):
    """A working family (patch_embeddings renamed) with ``attributes`` added to its class."""
    from fusion_patch_embeddings import PatchEmbeddingsFamily

    return type("TypoFamily", (PatchEmbeddingsFamily,), {"name": "typofam", **attributes})


def _no_op(self, *args):
    return None


MISSPELT_MEMBERS = [  # (the misspelt attribute, its value, the member it meant)
    ("module_transform", _no_op, "module_transforms"),
    ("owns_submodule", True, "owns_submodules"),
    ("sample_input", _no_op, "sample_inputs"),
    ("refusals", _no_op, "refusal"),
    ("tensor_paralel", None, "tensor_parallel"),
    ("preserve", "training_loss", "preserves"),
    ("make_transform", _no_op, "make_transforms"),  # a required member FusionFamily has a default for
    ("target_module_patterns", ("proj",), "target_modules_patterns"),
]


@pytest.mark.parametrize(("attribute", "value", "meant"), MISSPELT_MEMBERS, ids=[m[0] for m in MISSPELT_MEMBERS])
@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_misspelt_member_is_refused_naming_family_attribute_and_member(attribute, value, meant, where):
    if where == "class":
        spec = _family_class(**{attribute: value})()
    else:
        spec = _family_class()()
        setattr(spec, attribute, value)
    with pytest.raises(fusion_core.PluginError) as info:
        fusion_core.register_family(spec)
    message = str(info.value)
    assert f"family 'typofam': {attribute!r} is not a ModuleFusionSpec member (did you mean {meant!r}?)" in message
    assert "typofam" not in fusion_core.get_registry()


def test_a_misspelt_member_of_a_spec_without_a_base_class_is_refused():
    from fusion_patch_embeddings import PatchEmbeddingsFamily

    base = PatchEmbeddingsFamily()

    class Spec:  # implements the protocol directly
        name = "plainspec"
        description = "no base class"
        options_model = base.options_model
        target_modules_patterns = ()
        is_fusable = staticmethod(base.is_fusable)
        make_fused_class = staticmethod(base.make_fused_class)
        make_transforms = staticmethod(base.make_transforms)
        owns_submodule = True

    with pytest.raises(fusion_core.PluginError, match=r"'owns_submodule' .*did you mean 'owns_submodules'\?"):
        fusion_core.register_family(Spec())
    del Spec.owns_submodule
    fusion_core.register_family(Spec())
    assert "plainspec" in fusion_core.get_registry()


def test_every_misspelling_is_named_at_once():
    spec = _family_class(sample_input=_no_op, refusals=_no_op)()
    with pytest.raises(fusion_core.PluginError) as info:
        fusion_core.register_family(spec)
    assert "'refusals'" in str(info.value) and "'sample_input'" in str(info.value)


def test_helpers_of_a_family_are_not_misspellings():
    """Private names, names unlike any member, compounds of a member's name, and a sibling of a member the
    family defines itself (``refusals`` beside its own ``refusal``) are the family's own business."""
    spec = _family_class(
        _sample_input=_no_op, helper=_no_op, kernel_cache={}, names=("a", "b"), describe=_no_op,
        tensor_parallel_mesh=None, save_refusal=_no_op, transforms_for=_no_op,
        refusal=_no_op, refusals=("too small",), sample_inputs=_no_op, sample_input=_no_op,
    )()
    spec.cache = {}
    fusion_core.register_family(spec)
    assert "typofam" in fusion_core.get_registry()


def _cli_output(*args):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(list(args)) == 0
    return out.getvalue()


def test_the_shipped_families_register_with_their_helpers():
    registry = fusion_core.get_registry()
    assert not [str(f) for f in registry.failures if "not a ModuleFusionSpec member" in str(f)]
    assert {"patch_embeddings", "qkv", "gate_up", "moe_experts", "linear_kernels"} <= set(registry.names())
    listing = json.loads(_cli_output("list", "--json"))  # what `fusion list` shows
    assert {f["name"] for f in listing["families"]} == set(registry.names())


def test_a_new_optional_member_is_read_when_registering(monkeypatch):
    """The member names are read from fusion_core.spec at registration, so a member added there counts."""
    from fusion_core import spec as spec_module

    spec = _family_class(kernel_choise=_no_op)()
    fusion_core.register_family(spec)  # not near any member today
    fusion_core.unregister_family("typofam")
    monkeypatch.setitem(spec_module.OPTIONAL_MEMBERS, "kernel_choice", None)
    with pytest.raises(fusion_core.PluginError, match=r"'kernel_choise' .*did you mean 'kernel_choice'\?"):
        fusion_core.register_family(spec)



# -- families imported when first asked for (the fusion_core.families entry-point group) -----------------------

FAMILIES_GROUP = "fusion_core.families"


def test_a_family_entry_point_is_imported_when_its_family_is_first_asked_for(site, tmp_path, qwen_dir):
    marker = tmp_path / "imported"
    site.add("fusion-marker", "1.0", {"markerfam": "plugin"}, _marker_plugin(marker), group=FAMILIES_GROUP)
    registry = fusion_core.get_registry()
    _patch_embeddings_still_works(qwen_dir)
    assert not marker.exists()  # a load that does not enable it never imports it
    assert "markerfam" in registry and marker.exists()


def test_a_fused_load_imports_the_plugins_of_its_families_and_the_integrations_only(llama):
    """In a fresh process: the shipped families not enabled stay unimported; listing the families imports them."""
    script = textwrap.dedent(f"""
        import sys
        import fusion_core
        from transformers import AutoModelForCausalLM
        fusion_core.from_pretrained(AutoModelForCausalLM, {str(llama)!r}, fusion_config={{"qkv": True}})
        print(sorted(m for m in sys.modules if m.startswith("fusion_") and m.endswith(".plugin") and "core" not in m))
        fusion_core.get_registry().names()
        print(sorted(m for m in sys.modules if m.startswith("fusion_") and m.endswith(".plugin") and "core" not in m))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    at_load, listed = (eval(line) for line in result.stdout.strip().splitlines()[-2:])
    integrations = ["fusion_peft.plugin", "fusion_quantization.plugin", "fusion_tensor_parallel.plugin"]
    assert at_load == sorted(["fusion_qkv.plugin", *integrations])
    assert {"fusion_gate_up.plugin", "fusion_linear_kernels.plugin", "fusion_moe_experts.plugin"} <= set(listed)


def test_a_family_entry_point_registering_another_name_is_refused_naming_the_group(site):
    site.family("fusion-misnamed", "realname", entry_point="othername", group=FAMILIES_GROUP)
    registry = fusion_core.get_registry()
    assert "othername" not in registry and "realname" not in registry
    text = _failures_text()
    assert "fusion-misnamed" in text and "registers the one family it is named after ('othername')" in text
    assert "not family 'realname'" in text


def test_a_family_entry_point_registering_nothing_is_reported(site):
    site.family("fusion-empty", "emptyfam", group=FAMILIES_GROUP,
                register="\n@fusion_core.hookimpl\ndef register_fusion_families(register):\n    pass\n")
    with pytest.raises(fusion_core.UnknownFamilyError, match="registers no family 'emptyfam'"):
        fusion_core.get_registry().get("emptyfam")


def test_a_deferred_family_claimed_by_two_distributions_is_disabled(site):
    site.family("fusion-first", "twinfam", group=FAMILIES_GROUP)
    site.family("fusion-second", "twinfam", group=FAMILIES_GROUP)
    assert "twinfam" not in fusion_core.get_registry()
    assert "fusion-first" in _failures_text() and "fusion-second" in _failures_text()


def test_a_save_imports_the_plugins_of_the_families_the_model_holds(llama, tmp_path):
    """A fused model unpickled in a fresh process: its save runs its family's hooks (linear_kernels'), whose plugin
    nothing had imported."""
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"linear_kernels": True})
    torch.save(fused, tmp_path / "model.pt")
    script = textwrap.dedent(f"""
        import sys
        import torch
        import fusion_core
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        before = "fusion_linear_kernels.plugin" in sys.modules
        fusion_core.save_pretrained(model, {str(tmp_path / "saved")!r})
        print(before, "fusion_linear_kernels.plugin" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["False", "True"]
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (llama / "model.safetensors").read_bytes()
