"""The family registry: discovery, lookup by name and alias, recognition by duck typing, one-line misses."""
from __future__ import annotations

import pytest
from torch import nn

from d2export import families


class _Head(nn.Module):
    def __init__(self, *attrs):
        super().__init__()
        for a in attrs:
            setattr(self, a, nn.Identity())


class _Detector(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head


def test_every_family_module_is_discovered_and_named_uniquely():
    names = families.names()
    assert {"testr", "rcnn"} <= set(names) and len(names) == len(set(names))
    assert families.get("text_spotter") is families.get("testr")  # manifests of the first release


def test_unknown_family_name_lists_the_known_ones():
    with pytest.raises(families.FamilyError, match="known: .*testr"):
        families.get("bogus")


def test_recognise_finds_a_head_by_what_it_has():
    model = _Detector(_Head("backbone", "transformer", "ctrl_point_class", "ctrl_point_coord", "text_class"))
    assert families.recognise(model).name == "testr"


def test_no_family_fits_names_each_family_and_what_it_lacked():
    model = _Detector(_Head("backbone", "transformer"))
    with pytest.raises(families.FamilyError) as e:
        families.recognise(model)
    message = str(e.value)
    assert "\n" not in message and "_Detector" in message
    for name in families.names():
        assert f"{name}: " in message
    assert "ctrl_point_class" in message  # what TESTR's head lacked


def test_a_wrong_explicit_family_says_what_the_model_lacks():
    model = _Detector(_Head("backbone", "transformer", "ctrl_point_class", "ctrl_point_coord", "text_class"))
    with pytest.raises(families.FamilyError, match="not a model of family 'rcnn'.*do_postprocess"):
        families.recognise(model, "rcnn")
