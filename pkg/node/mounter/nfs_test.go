package mounter

import (
	"slices"
	"testing"
)

func TestNFSSource(t *testing.T) {
	for _, c := range []struct{ endpoint, export, want string }{
		{"10.53.0.10", "/pvc-1", "10.53.0.10:/pvc-1"},
		{"fd00::a", "/pvc-1", "[fd00::a]:/pvc-1"},
		{"share.longhorn-system.svc", "/pvc-1", "share.longhorn-system.svc:/pvc-1"},
	} {
		if got, err := NFSSource(c.endpoint, c.export); err != nil || got != c.want {
			t.Errorf("NFSSource(%q, %q) = %q, %v; want %q", c.endpoint, c.export, got, err, c.want)
		}
	}
	for _, c := range []struct{ endpoint, export string }{
		{"", "/pvc-1"}, {"10.0.0.1", ""},
		{"-o", "/pvc-1"}, {"10.0.0.1,vers=3", "/pvc-1"}, {"a b", "/pvc-1"}, {"host:/other", "/pvc-1"},
		{"10.0.0.1", "pvc-1"}, {"10.0.0.1", "/a/../etc"}, {"10.0.0.1", "/pvc-1,vers=3"}, {"10.0.0.1", "/pvc 1"}, {"10.0.0.1", "/a:b"},
	} {
		if got, err := NFSSource(c.endpoint, c.export); err == nil {
			t.Errorf("NFSSource(%q, %q) = %q, want an error", c.endpoint, c.export, got)
		}
	}
}

func TestNFSOptions(t *testing.T) {
	for _, c := range []struct {
		flags       []string
		recommended string
		want        []string
	}{
		{nil, "", []string{"vers=4"}},
		{[]string{"noatime"}, "", []string{"vers=4", "noatime"}},
		{[]string{"nfsvers=4.2"}, "", []string{"nfsvers=4.2"}},
		{nil, "vers=4.1,noresvport", []string{"vers=4.1", "noresvport"}},
		// The StorageClass's options come last: mount(8) lets them win.
		{[]string{"vers=3", "hard"}, "vers=4.1", []string{"vers=4.1", "vers=3", "hard"}},
		{[]string{" ", ""}, " softerr ,", []string{"vers=4", "softerr"}},
	} {
		if got := NFSOptions(c.flags, c.recommended); !slices.Equal(got, c.want) {
			t.Errorf("NFSOptions(%q, %q) = %q, want %q", c.flags, c.recommended, got, c.want)
		}
	}
}

func TestSameNFSSource(t *testing.T) {
	if !SameNFSSource("10.0.0.1:/pvc-1/", "10.0.0.1:/pvc-1") || SameNFSSource("10.0.0.1:/pvc-1", "10.0.0.2:/pvc-1") {
		t.Error("SameNFSSource compares wrongly")
	}
	if !IsNFS("nfs4") || !IsNFS("nfs") || IsNFS("ext4") {
		t.Error("IsNFS")
	}
}
