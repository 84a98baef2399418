"""A rig's hosts and links are checked before anything is made (so without root): names that make interface names,
links between two of its hosts, rates in tc's notation, and no host left on no path."""

from __future__ import annotations

import re

import pytest

from tests.support.hosts import HostSpec, LinkSpec, Rig

TWO = [HostSpec("studio", cpu=0.8), HostSpec("mba", cpu=0.4)]


@pytest.mark.parametrize(
    ("hosts", "links", "message"),
    [
        ([HostSpec("Studio")], [], "rig name 'Studio': expected a lowercase letter then up to 7 letters or digits"),
        ([HostSpec("macbookair")], [], "rig name 'macbookair'"),
        ([HostSpec("lan")], [], "rig name 'lan'"),
        (TWO, [LinkSpec("lan", "studio", "mba")], "rig name 'lan'"),
        ([*TWO, HostSpec("mba")], [], "rig names must be unique: hosts ['studio', 'mba', 'mba']"),
        (TWO, [LinkSpec("tb", "studio", "mbp")], "link 'tb': joins 'studio' and 'mbp'; expected two of the hosts"),
        (TWO, [LinkSpec("tb", "mba", "mba")], "link 'tb': joins 'mba' and 'mba'"),
        (TWO, [LinkSpec("tb", "studio", "mba", rate="1gb")], "link rate '1gb': expected unshaped or a number with"),
        ([HostSpec("studio", lan="fast")], [], "link rate 'fast'"),
        ([HostSpec("studio", cpu=0)], [], "host 'studio': cpu 0: expected a positive number of cores, or None"),
        ([*TWO, HostSpec("mbp", lan=None)], [], "hosts ['mbp'] are on no path: give them a LAN rate or a link"),
    ],
)
def test_a_rig_that_cannot_be_made_is_refused_before_anything_is_made(tmp_path, hosts, links, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Rig(tmp_path, hosts, links)
    assert list(tmp_path.iterdir()) == []
