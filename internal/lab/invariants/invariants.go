// Package invariants holds the lab's checkers. Each works on a plain
// snapshot of state (gathered elsewhere from the guest and host API servers,
// the mount table and the loop devices), so each can be shown to fire on a
// fabricated violation.
package invariants

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"
)

// Kinds of violation.
const (
	KindRWOHost    = "rwo-two-vmis"       // a volume Ready in two VMIs
	KindRWOStaged  = "rwo-two-nodes"      // a volume staged (and attached) on two guest nodes
	KindDataLoss   = "data-mismatch"      // a workload verification failed
	KindStuck      = "stuck"              // a pod or VolumeAttachment stuck beyond the bound
	KindFinalDrift = "final-disagreement" // after quiescing, two views of attachments differ
	KindLeak       = "leak"               // after quiescing, something is left behind
)

// KindRWOHostNodes: a Longhorn volume attached on two host nodes outside a
// Longhorn migration.
const KindRWOHostNodes = "rwo-two-host-nodes"

// Violation is one broken invariant.
type Violation struct {
	Kind    string    `json:"kind"`
	Volume  string    `json:"volume,omitempty"`
	Nodes   []string  `json:"nodes,omitempty"`
	At      time.Time `json:"at"`
	Details string    `json:"details"`
}

func (v Violation) String() string {
	s := v.Kind
	if v.Volume != "" {
		s += " volume=" + v.Volume
	}
	if len(v.Nodes) > 0 {
		s += " nodes=" + strings.Join(v.Nodes, ",")
	}
	return s + ": " + v.Details
}

// Key identifies a violation for de-duplication across repeated checks.
func (v Violation) Key() string {
	return v.Kind + "|" + v.Volume + "|" + strings.Join(v.Nodes, ",")
}

// VMIVolumes is a VMI's volumeStatus: volume -> phase.
type VMIVolumes map[string]string

// RWOHost reports every volume that is Ready in more than one VMI. vmis maps
// VM name to its VMI's volumeStatus.
func RWOHost(now time.Time, vmis map[string]VMIVolumes) []Violation {
	where := map[string][]string{}
	for vm, vols := range vmis {
		for vol, phase := range vols {
			if phase == "Ready" {
				where[vol] = append(where[vol], vm)
			}
		}
	}
	return multi(now, KindRWOHost, where, "Ready in the VMIs of")
}

// Staged is one staging mount on a guest node.
type Staged struct {
	Node, Volume string
	// Attached: the device under the mount is still plugged into that
	// node's VM (a stale mount of an unplugged disk is a leak, not a second
	// live attachment).
	Attached bool
}

// RWOStaged reports every volume staged with a live device on more than one
// guest node.
func RWOStaged(now time.Time, staged []Staged) []Violation {
	where := map[string][]string{}
	for _, s := range staged {
		if s.Attached && !slices.Contains(where[s.Volume], s.Node) {
			where[s.Volume] = append(where[s.Volume], s.Node)
		}
	}
	return multi(now, KindRWOStaged, where, "staged with a live device on nodes")
}

func multi(now time.Time, kind string, where map[string][]string, what string) []Violation {
	var out []Violation
	for _, vol := range slices.Sorted(maps.Keys(where)) {
		nodes := where[vol]
		if len(nodes) < 2 {
			continue
		}
		sort.Strings(nodes)
		out = append(out, Violation{Kind: kind, Volume: vol, Nodes: nodes, At: now,
			Details: fmt.Sprintf("ReadWriteOnce volume %s %s %s at once", vol, what, strings.Join(nodes, ", "))})
	}
	return out
}

// HostVolume is a Longhorn volume on the host as Longhorn's objects and the
// host's VolumeAttachments show it, each list naming host nodes.
type HostVolume struct {
	Name string
	// Migratable: Longhorn may run it on two host nodes while it migrates
	// (a migratable RWX volume); Migrating: a migration is under way
	// (spec.migrationNodeID or status.currentMigrationNodeID set).
	Migratable, Migrating bool
	// Engines: where its engines run (status.currentNodeID, attached or
	// still detaching, and status.currentMigrationNodeID).
	Engines []string
	// Tickets: the nodes of its satisfied attachment tickets.
	Tickets []string
	// HostVAs: the nodes of its host VolumeAttachments that say attached
	// and are not being deleted (a deleted one is being detached: its
	// ticket may be gone already while the attacher has not yet written
	// attached=false).
	HostVAs []string
}

// RWOHostNodes reports every Longhorn volume attached on more than one host
// node by any of the views, except a migratable volume during its
// migration, which Longhorn runs on the old and the new node until it
// confirms or rolls back (longhorn-manager v1.10.1
// controller/volume_attachment_controller.go). A guest move between VMs on
// two host nodes must wait for the old host node to let go: otherwise the
// guest data could be written through both. A volume with no engine and
// no satisfied ticket has no data path on any node, whatever its host
// VolumeAttachments still say (Longhorn faulting a volume stops its engines
// and drops a migration under way, volume_controller.go, while nothing
// makes the host's attacher write attached=false), so it is not reported.
func RWOHostNodes(now time.Time, vols []HostVolume) []Violation {
	var out []Violation
	for _, v := range vols {
		if len(v.Engines) == 0 && len(v.Tickets) == 0 {
			continue
		}
		nodes := union(v.Engines, v.Tickets, v.HostVAs)
		if len(nodes) < 2 || (v.Migratable && v.Migrating && len(nodes) == 2) {
			continue
		}
		what := "RWO"
		if v.Migratable {
			what = "migratable, outside a migration,"
			if v.Migrating {
				what = "migrating, on more than two nodes,"
			}
		}
		out = append(out, Violation{Kind: KindRWOHostNodes, Volume: v.Name, Nodes: nodes, At: now,
			Details: fmt.Sprintf("Longhorn volume %s (%s) attached on host nodes %s at once: engines on %v, satisfied tickets on %v, host VolumeAttachments attached on %v",
				v.Name, what, strings.Join(nodes, ", "), v.Engines, v.Tickets, v.HostVAs)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Volume < out[j].Volume })
	return out
}

func union(lists ...[]string) []string {
	var out []string
	for _, l := range lists {
		for _, n := range l {
			if n != "" && !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	sort.Strings(out)
	return out
}

// DataCheck is one workload verification (see package agent).
type DataCheck struct {
	At                     time.Time
	Role, Volume, Pod      string
	Node                   string
	OK                     bool
	Records                int
	Expected, Got, Details string
}

// Data reports every failed verification.
func Data(checks []DataCheck) []Violation {
	var out []Violation
	for _, c := range checks {
		if c.OK {
			continue
		}
		out = append(out, Violation{Kind: KindDataLoss, Volume: c.Volume, Nodes: []string{c.Node}, At: c.At,
			Details: fmt.Sprintf("%s pod %s on node %s: %s (expected checksum %q, got %q, %d records)",
				c.Role, c.Pod, c.Node, c.Details, c.Expected, c.Got, c.Records)})
	}
	return out
}

// Pending is something in progress: a VolumeAttachment attaching or
// detaching, a pod waiting for its volumes.
type Pending struct {
	What   string // "attach", "detach", "pod"
	Name   string // VolumeAttachment or namespace/pod
	Volume string
	Node   string
	Since  time.Time
	// Context is printed with a stuck report: the guest VA, the VM spec,
	// the VMI's volumeStatus and the driver's log lines.
	Context string
}

// Stuck reports every pending item older than bound.
func Stuck(now time.Time, bound time.Duration, pending []Pending) []Violation {
	var out []Violation
	for _, p := range pending {
		if age := now.Sub(p.Since); age > bound {
			var nodes []string
			if p.Node != "" {
				nodes = []string{p.Node}
			}
			out = append(out, Violation{Kind: KindStuck, Volume: p.Volume, Nodes: nodes, At: now,
				Details: fmt.Sprintf("%s %s in progress for %s (bound %s)\n%s", p.What, p.Name, age.Round(time.Second), bound, p.Context)})
		}
	}
	return out
}

// Pair is a (node, volume) attachment; node is the guest node and VM name.
type Pair struct{ Node, Volume string }

func (p Pair) String() string { return p.Volume + "@" + p.Node }

// Final is the state after quiescing, from every view.
type Final struct {
	// VolumeAttachments: guest VAs (attached or not).
	VolumeAttachments []Pair
	// VMSpec: hotplug volumes in the VMs' specs.
	VMSpec []Pair
	// VolumeRequests: pending requests in VM status, per VM.
	VolumeRequests map[string]int
	// VMIStatus: hotplug entries of the VMIs' volumeStatus.
	VMIStatus []Pair
	// ByID: by-id links in the nodes' by-id directories.
	ByID []Pair
	// Staged and Published: mounts under the kubelets' directories.
	Staged    []Pair
	Published []Pair
	// LoopDevices: loop devices on the lab's backing files.
	LoopDevices []string
	// ExpectEmpty: the workload was deleted, so every view must be empty.
	ExpectEmpty bool
}

// FinalAgreement reports every disagreement between the views after
// quiescing, and everything left behind.
func FinalAgreement(now time.Time, f Final) []Violation {
	var out []Violation
	add := func(kind, vol string, nodes []string, format string, a ...any) {
		out = append(out, Violation{Kind: kind, Volume: vol, Nodes: nodes, At: now, Details: fmt.Sprintf(format, a...)})
	}
	ref := set(f.VolumeAttachments)
	views := []struct {
		name  string
		pairs []Pair
	}{{"VM spec", f.VMSpec}, {"VMI volumeStatus", f.VMIStatus}, {"by-id links", f.ByID}}
	for _, v := range views {
		got := set(v.pairs)
		for p := range got {
			if !ref[p] {
				add(KindFinalDrift, p.Volume, []string{p.Node}, "%s lists %s but no guest VolumeAttachment does (ghost)", v.name, p)
			}
		}
		for p := range ref {
			if !got[p] {
				add(KindFinalDrift, p.Volume, []string{p.Node}, "guest VolumeAttachment %s is missing from the %s", p, v.name)
			}
		}
	}
	for _, vm := range slices.Sorted(maps.Keys(f.VolumeRequests)) {
		if n := f.VolumeRequests[vm]; n > 0 {
			add(KindLeak, "", []string{vm}, "VM %s still has %d status.volumeRequests", vm, n)
		}
	}
	for p := range set(f.Staged) {
		if !ref[p] {
			add(KindLeak, p.Volume, []string{p.Node}, "staging mount of %s left on a node it is not attached to", p)
		}
	}
	for p := range set(f.Published) {
		if !ref[p] {
			add(KindLeak, p.Volume, []string{p.Node}, "publish mount of %s left on a node it is not attached to", p)
		}
	}
	if len(f.LoopDevices) != len(set(f.ByID)) {
		add(KindLeak, "", nil, "%d loop devices on the lab's disks but %d plugged disks (by-id links): %v",
			len(f.LoopDevices), len(set(f.ByID)), f.LoopDevices)
	}
	if f.ExpectEmpty {
		for p := range ref {
			add(KindLeak, p.Volume, []string{p.Node}, "guest VolumeAttachment %s left after the workload was deleted", p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Details < out[j].Details })
	return out
}

func set(ps []Pair) map[Pair]bool {
	m := make(map[Pair]bool, len(ps))
	for _, p := range ps {
		m[p] = true
	}
	return m
}
