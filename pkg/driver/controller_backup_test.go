package driver

import "testing"

func TestParseBackupID(t *testing.T) {
	for _, c := range []struct {
		id       string
		ns, name string
		ok       bool
	}{
		{"backup:guests/snapshot-1", "guests", "snapshot-1", true},
		{"backup:guests/a.b", "guests", "a.b", true},
		{"backup:guests", "", "", false},
		{"backup:/x", "", "", false},
		{"backup:guests/", "", "", false},
		{"backup:Guests/x", "", "", false},
		{"backup:guests/x/y", "", "", false},
		{"backup:guests:x", "", "", false}, // the design document's form, never what either driver issued
		{"snapshot-1", "", "", false},
	} {
		ns, name, ok := parseBackupID(c.id)
		if ns != c.ns || name != c.name || ok != c.ok {
			t.Errorf("parseBackupID(%q) = %q, %q, %v; want %q, %q, %v", c.id, ns, name, ok, c.ns, c.name, c.ok)
		}
		if ok && backupID(ns, name) != c.id {
			t.Errorf("backupID(%q, %q) = %q, want %q", ns, name, backupID(ns, name), c.id)
		}
	}
}
