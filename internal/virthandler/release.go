package virthandler

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Release is what one KubeVirt release's virt-handler does with hotplug
// volumes, where releases differ. Every field names the tags that have the
// behaviour, with the line at one tag; doc.go has the whole table.
type Release struct {
	// Version is the KubeVirt version the behaviours were derived from.
	Version string
	// FirstUIDReuse: mountFromPod takes the attachment pod UID of the first
	// hotplug entry that has one as the source of every later entry, removed
	// entries included (v1.5.2 mount.go:330, v1.6.0/v1.6.3/v1.6.6 :326,
	// v1.7.0/v1.7.4 :345, v1.8.2/v1.8.4 :349 `if sourceUID == ""`). A new
	// volume sorting after an entry of another pod is looked up in that pod
	// and fails. v1.9.0 (kubevirt PR 18105, commit fa3d5a2c68) gives each
	// entry its own UID (v1.9.0 mount.go:363-366).
	FirstUIDReuse bool
	// RemountRemoved: mountFromPod walks entries of volumes already removed
	// from the spec and re-creates their device in virt-launcher while their
	// old attachment pod still lists them (every tag up to v1.9.0; main
	// skips them from kubevirt PR 18044, commit 7190a59269).
	RemountRemoved bool
	// UnmountStopsAtFirstFailure: Unmount returns at the first mount-record
	// path that fails, leaving the later removed volumes mounted and the
	// record unsaved (v1.6.0 mount.go:677-691, v1.7.0 :696-712, v1.8.2
	// :723-739; kubevirt issue 16537). v1.9.0 (PR 16742, commit 4cf28f860b)
	// tries every path and keeps only the failed ones.
	UnmountStopsAtFirstFailure bool
	// MountErrorFailsPass: any mount error fails the whole pass, a missing
	// source included (v1.5.2 vm.go:3111-3113). From v1.6.0 a missing source
	// (os.ErrNotExist) is only a HotplugFailed event and the pass goes on
	// (v1.6.0 vm.go:1976-1981, v1.7.0 :1991-1996, v1.8.2 :1904-1909).
	MountErrorFailsPass bool
}

// ForVersion returns the virt-handler of a KubeVirt version: a tag such as
// "v1.7.0" or "1.6.6", or "main" (kubevirt/kubevirt main with PR 18044).
// Versions before 1.5 are refused: nothing here was checked against them.
func ForVersion(version string) (Release, error) {
	if version == "main" {
		return Release{Version: version}, nil
	}
	minor, err := minorOf(version)
	if err != nil {
		return Release{}, err
	}
	return Release{
		Version:                    version,
		FirstUIDReuse:              minor <= 8,
		RemountRemoved:             true,
		UnmountStopsAtFirstFailure: minor <= 8,
		MountErrorFailsPass:        minor == 5,
	}, nil
}

// minorOf parses "v1.M.P" or "1.M.P" (a pre-release suffix is allowed) and
// returns M, for M >= 5.
func minorOf(version string) (int, error) {
	parts := strings.SplitN(strings.TrimPrefix(version, "v"), ".", 3)
	if len(parts) < 2 || parts[0] != "1" {
		return 0, fmt.Errorf("virthandler: KubeVirt version %q is not 1.x.y or main", version)
	}
	minor, err := strconv.Atoi(parts[1])
	if err != nil || minor < 5 {
		return 0, fmt.Errorf("virthandler: KubeVirt version %q: want 1.5 or later or main", version)
	}
	return minor, nil
}

// Timings are the handler's stage latencies, already scaled; the handler
// jitters each one as it starts it.
type Timings struct {
	// Mount is from a volume's entry naming a pod that holds it to its
	// device existing in virt-launcher (the mknod; ~0.1 s).
	Mount time.Duration
	// DomainAttach is from a mounted volume being MountedToPod to the domain
	// having the disk, a target (~1-2 s).
	DomainAttach time.Duration
	// Unplug is from a volume leaving the spec to the domain having let the
	// disk go; virt-handler unmounts it in the same pass (~0.2-1 s).
	Unplug time.Duration
	// Poll is virt-handler's requeue while a hotplug entry has no target
	// (1 s: v1.7.0 pkg/virt-handler/vm.go:652).
	Poll time.Duration
	// IOErrorWait and IOErrorMaxWait bound the delays of a VMI whose domain
	// paused on an I/O error (10 s doubling to 3 min, every tag: v1.7.0
	// vm.go:187 NewFailRetryManager, applied at :1442-1448).
	IOErrorWait, IOErrorMaxWait time.Duration
	// IOErrorWindow is how soon another I/O error counts as the same one
	// (30 s).
	IOErrorWindow time.Duration
}

// DefaultTimings are the unscaled stage latencies of a Harvester host.
func DefaultTimings() Timings {
	return Timings{
		Mount:          100 * time.Millisecond,
		DomainAttach:   1500 * time.Millisecond,
		Unplug:         500 * time.Millisecond,
		Poll:           time.Second,
		IOErrorWait:    10 * time.Second,
		IOErrorMaxWait: 3 * time.Minute,
		IOErrorWindow:  30 * time.Second,
	}
}

// Scaled multiplies every latency by scale.
func (t Timings) Scaled(scale float64) Timings {
	for _, d := range []*time.Duration{&t.Mount, &t.DomainAttach, &t.Unplug, &t.Poll, &t.IOErrorWait, &t.IOErrorMaxWait, &t.IOErrorWindow} {
		*d = time.Duration(float64(*d) * scale)
	}
	return t
}
