package invariants

import (
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestRWOHostFiresOnAVolumeReadyInTwoVMIs(t *testing.T) {
	vmis := map[string]VMIVolumes{
		"node-0": {"pvc-a": "Ready", "pvc-b": "Ready"},
		"node-1": {"pvc-a": "Ready", "pvc-c": "Detaching"},
		"node-2": {"pvc-b": "AttachedToNode"}, // not Ready: fine
	}
	got := RWOHost(t0, vmis)
	if len(got) != 1 || got[0].Kind != KindRWOHost || got[0].Volume != "pvc-a" || strings.Join(got[0].Nodes, ",") != "node-0,node-1" {
		t.Fatalf("got %v, want one violation for pvc-a on node-0 and node-1", got)
	}
	delete(vmis, "node-1")
	if got := RWOHost(t0, vmis); len(got) != 0 {
		t.Fatalf("no volume is Ready twice, got %v", got)
	}
}

func TestRWOStagedFiresOnlyForLiveDevices(t *testing.T) {
	staged := []Staged{
		{Node: "node-0", Volume: "pvc-a", Attached: true},
		{Node: "node-1", Volume: "pvc-a", Attached: true},
		{Node: "node-0", Volume: "pvc-b", Attached: true},
		{Node: "node-2", Volume: "pvc-b", Attached: false}, // stale mount of an unplugged disk
	}
	got := RWOStaged(t0, staged)
	if len(got) != 1 || got[0].Volume != "pvc-a" || got[0].Kind != KindRWOStaged {
		t.Fatalf("got %v, want pvc-a only", got)
	}
}

func TestDataFiresOnAMismatchWithBothChecksums(t *testing.T) {
	checks := []DataCheck{
		{Role: "db", Volume: "pvc-a", Pod: "ns1/db-0", Node: "node-0", OK: true, Records: 10},
		{Role: "backup", Volume: "pvc-b", Pod: "ns1/backup-1", Node: "node-2", OK: false, Expected: "abc", Got: "def", Details: "backup file does not match its checksum"},
	}
	got := Data(checks)
	if len(got) != 1 {
		t.Fatalf("got %v, want one violation", got)
	}
	for _, want := range []string{"pvc-b", "ns1/backup-1", "node-2", `"abc"`, `"def"`} {
		if !strings.Contains(got[0].String(), want) {
			t.Errorf("violation %q does not name %s", got[0], want)
		}
	}
}

func TestStuckFiresBeyondTheBound(t *testing.T) {
	pending := []Pending{
		{What: "attach", Name: "csi-1", Volume: "pvc-a", Node: "node-0", Since: t0.Add(-6 * time.Minute), Context: "VMI volumeStatus: pvc-a AttachedToNode"},
		{What: "pod", Name: "ns/p", Volume: "pvc-b", Node: "node-1", Since: t0.Add(-4 * time.Minute)},
	}
	got := Stuck(t0, 5*time.Minute, pending)
	if len(got) != 1 || got[0].Volume != "pvc-a" || !strings.Contains(got[0].Details, "AttachedToNode") {
		t.Fatalf("got %v, want the attach of pvc-a with its context", got)
	}
}

func TestFinalAgreementFiresOnGhostsAndLeaks(t *testing.T) {
	clean := Final{
		VolumeAttachments: []Pair{{"node-0", "pvc-a"}},
		VMSpec:            []Pair{{"node-0", "pvc-a"}},
		VMIStatus:         []Pair{{"node-0", "pvc-a"}},
		ByID:              []Pair{{"node-0", "pvc-a"}},
		Staged:            []Pair{{"node-0", "pvc-a"}},
		LoopDevices:       []string{"/dev/loop3"},
		VolumeRequests:    map[string]int{"node-0": 0},
	}
	if got := FinalAgreement(t0, clean); len(got) != 0 {
		t.Fatalf("views agree, got %v", got)
	}
	cases := map[string]func(f *Final){
		"ghost in the VM spec":      func(f *Final) { f.VMSpec = append(f.VMSpec, Pair{"node-1", "pvc-z"}) },
		"missing from the VMI":      func(f *Final) { f.VMIStatus = nil },
		"pending volumeRequests":    func(f *Final) { f.VolumeRequests["node-1"] = 2 },
		"stale staging mount":       func(f *Final) { f.Staged = append(f.Staged, Pair{"node-2", "pvc-a"}) },
		"publish mount left":        func(f *Final) { f.Published = []Pair{{"node-1", "pvc-q"}} },
		"leaked loop device":        func(f *Final) { f.LoopDevices = append(f.LoopDevices, "/dev/loop9") },
		"attachment after deletion": func(f *Final) { f.ExpectEmpty = true },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			f := clean
			f.VolumeRequests = map[string]int{"node-0": 0}
			f.VMSpec = append([]Pair(nil), clean.VMSpec...)
			f.Staged = append([]Pair(nil), clean.Staged...)
			f.LoopDevices = append([]string(nil), clean.LoopDevices...)
			mutate(&f)
			if got := FinalAgreement(t0, f); len(got) == 0 {
				t.Fatal("no violation")
			}
		})
	}
}

func TestRWOHostNodesFiresOnAVolumeOnTwoHostNodes(t *testing.T) {
	vols := []HostVolume{
		// The old host node's engine still detaching while the new one's
		// host VolumeAttachment says attached: the move did not wait.
		{Name: "pvc-rwo", Engines: []string{"harvester-0"}, HostVAs: []string{"harvester-1"}},
		// A migratable volume on two nodes with no migration under way.
		{Name: "pvc-mig-idle", Migratable: true, Engines: []string{"harvester-0"}, Tickets: []string{"harvester-0", "harvester-2"}},
		// A migration: old and new node at once is Longhorn's rule.
		{Name: "pvc-migrating", Migratable: true, Migrating: true, Engines: []string{"harvester-0", "harvester-1"},
			Tickets: []string{"harvester-0", "harvester-1"}, HostVAs: []string{"harvester-0", "harvester-1"}},
		// One node in every view.
		{Name: "pvc-ok", Engines: []string{"harvester-2"}, Tickets: []string{"harvester-2"}, HostVAs: []string{"harvester-2"}},
		// An RWO volume that is not migratable gets no migration pass.
		{Name: "pvc-rwo-migrating", Migrating: true, Engines: []string{"harvester-0", "harvester-1"}},
		// Faulted during a migration: Longhorn stopped both engines and
		// dropped the migration, the host's VolumeAttachments still say
		// attached on both nodes; no engine runs, no data path anywhere.
		{Name: "pvc-faulted", Migratable: true, HostVAs: []string{"harvester-0", "harvester-2"}},
		// An engine on one node and another node's VolumeAttachment
		// attached: still reported.
		{Name: "pvc-stale-va", Migratable: true, Engines: []string{"harvester-2"}, HostVAs: []string{"harvester-0", "harvester-2"}},
	}
	got := RWOHostNodes(t0, vols)
	var names []string
	for _, v := range got {
		if v.Kind != KindRWOHostNodes {
			t.Errorf("kind %s, want %s", v.Kind, KindRWOHostNodes)
		}
		names = append(names, v.Volume+"@"+strings.Join(v.Nodes, ","))
	}
	want := "pvc-mig-idle@harvester-0,harvester-2 pvc-rwo@harvester-0,harvester-1 pvc-rwo-migrating@harvester-0,harvester-1 pvc-stale-va@harvester-0,harvester-2"
	if strings.Join(names, " ") != want {
		t.Fatalf("got %v, want %s", got, want)
	}
	if !strings.Contains(got[1].Details, "engines on [harvester-0]") || !strings.Contains(got[1].Details, "host VolumeAttachments attached on [harvester-1]") {
		t.Errorf("details do not say which view saw which node: %s", got[1].Details)
	}
}
