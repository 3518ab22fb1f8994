package virthandler

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Every version the table must answer, with the behaviours it has.
func TestReleaseTable(t *testing.T) {
	type row struct{ firstUID, remount, unmountStops, mountErrFails bool }
	bugs := row{true, true, true, false}
	for version, want := range map[string]row{
		"v1.5.2": {true, true, true, true}, "v1.5.3": {true, true, true, true}, "1.5.2": {true, true, true, true},
		"v1.6.0": bugs, "v1.6.3": bugs, "1.6.6": bugs, "v1.7.0": bugs, "1.7.4": bugs,
		"v1.8.2": bugs, "v1.8.4": bugs, "1.8.4": bugs,
		"v1.9.0": {false, true, false, false},
		"main":   {},
	} {
		rel, err := ForVersion(version)
		if err != nil {
			t.Fatalf("%s: %v", version, err)
		}
		got := row{rel.FirstUIDReuse, rel.RemountRemoved, rel.UnmountStopsAtFirstFailure, rel.MountErrorFailsPass}
		if got != want {
			t.Errorf("%s: %+v, want %+v", version, got, want)
		}
	}
	for _, bad := range []string{"", "v1.4.0", "2.0.0", "latest"} {
		if _, err := ForVersion(bad); err == nil {
			t.Errorf("ForVersion(%q) accepted", bad)
		}
	}
}

// fixture is one VMI on one handler, with virt-controller's part played by
// the test between passes.
type fixture struct {
	t    *testing.T
	h    *Handler
	vmi  *kubevirtv1.VirtualMachineInstance
	pods []Pod
	now  time.Time
	hook *hookLog
	last Result
}

func newFixture(t *testing.T, version string) *fixture {
	rel, err := ForVersion(version)
	if err != nil {
		t.Fatal(err)
	}
	hook := &hookLog{}
	tm := Timings{Poll: time.Second, IOErrorWait: 10 * time.Second, IOErrorMaxWait: 3 * time.Minute, IOErrorWindow: 30 * time.Second}
	vmi := &kubevirtv1.VirtualMachineInstance{}
	vmi.Namespace, vmi.Name, vmi.UID = "guests", "vm-0", "vmi-uid"
	vmi.Status.Phase = kubevirtv1.Running
	return &fixture{t: t, h: New(rel, tm, nil, hook, klog.Background()), vmi: vmi, now: time.Unix(1000, 0), hook: hook}
}

func hotVolume(name string) kubevirtv1.Volume {
	return kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "claim-" + name}, Hotpluggable: true}}}
}

// add puts the volume in the spec with an entry virt-controller has
// pointed at pod.
func (f *fixture) add(name string, pod types.UID) {
	f.vmi.Spec.Volumes = append(f.vmi.Spec.Volumes, hotVolume(name))
	f.vmi.Status.VolumeStatus = append(f.vmi.Status.VolumeStatus, kubevirtv1.VolumeStatus{
		Name: name, Phase: kubevirtv1.HotplugVolumeAttachedToNode, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{AttachPodUID: pod}})
	slices.SortFunc(f.vmi.Status.VolumeStatus, func(a, b kubevirtv1.VolumeStatus) int { return strings.Compare(a.Name, b.Name) })
}

func (f *fixture) remove(names ...string) {
	f.vmi.Spec.Volumes = slices.DeleteFunc(f.vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return slices.Contains(names, v.Name) })
}

// drop is virt-controller dropping an entry once no pod holds its volume.
func (f *fixture) drop(name string) {
	f.vmi.Status.VolumeStatus = slices.DeleteFunc(f.vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == name })
}

// pass runs one pass a second after the last and writes its status.
func (f *fixture) pass() Result {
	f.t.Helper()
	f.now = f.now.Add(time.Second)
	res := f.h.Sync(context.Background(), f.vmi, f.pods, f.now)
	if res.Entries != nil {
		f.vmi.Status.VolumeStatus = res.Entries
	}
	f.last = res
	return res
}

// settle runs passes until the status stops changing (and a few more).
func (f *fixture) settle() {
	for range 8 {
		f.pass()
	}
}

func (f *fixture) entry(name string) kubevirtv1.VolumeStatus {
	i := slices.IndexFunc(f.vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == name })
	if i < 0 {
		f.t.Fatalf("no entry %s in %+v", name, f.vmi.Status.VolumeStatus)
	}
	return f.vmi.Status.VolumeStatus[i]
}

func (f *fixture) wantPhase(name string, want kubevirtv1.VolumePhase) {
	f.t.Helper()
	if e := f.entry(name); e.Phase != want {
		f.t.Fatalf("%s: %s is %s (target %q), want %s; last pass %+v", f.h.rel.Version, name, e.Phase, e.Target, want, f.last)
	}
}

func hasEvent(events []Event, reason string) bool {
	return slices.ContainsFunc(events, func(e Event) bool { return e.Reason == reason })
}

// attached brings volumes held by one pod to Ready.
func (f *fixture) attached(pod types.UID, names ...string) {
	f.t.Helper()
	f.pods = append(f.pods, Pod{UID: pod, Volumes: names})
	for _, n := range names {
		f.add(n, pod)
	}
	f.settle()
	for _, n := range names {
		f.wantPhase(n, kubevirtv1.VolumeReady)
	}
}

// A volume steps through the phases virt-handler's guards allow, with the
// disk hook around the domain's part: MountedToPod, Ready once the domain
// has the disk, UnMountedFromPod once it let it go and the device is gone;
// a failing hook fails the pass and holds the entry.
func TestVolumeLifecycle(t *testing.T) {
	f := newFixture(t, "v1.7.0")
	f.pods = []Pod{{UID: "pod-1", Volumes: []string{"a"}}}
	f.add("a", "pod-1")
	f.hook.fail = true
	f.pass()
	f.wantPhase("a", kubevirtv1.HotplugVolumeMounted)
	if res := f.pass(); res.Err == nil || !hasEvent(res.Events, ReasonSyncFailed) {
		t.Fatalf("a failing plug did not fail the pass: %+v", res)
	}
	f.wantPhase("a", kubevirtv1.HotplugVolumeMounted)
	f.hook.fail = false
	f.pass() // the domain takes the disk; the status shows the domain the pass began with
	f.wantPhase("a", kubevirtv1.HotplugVolumeMounted)
	f.pass()
	f.wantPhase("a", kubevirtv1.VolumeReady)
	if e := f.entry("a"); e.Target != "sda" {
		t.Fatalf("target %q, want sda", e.Target)
	}
	f.remove("a")
	f.hook.fail = true
	f.settle()
	f.wantPhase("a", kubevirtv1.VolumeReady) // the unplug fails: still in the domain
	f.hook.fail = false
	f.settle()
	f.wantPhase("a", kubevirtv1.HotplugVolumeUnMounted)
	if f.h.Mounted(f.vmi.UID, "a") {
		t.Fatal("a still mounted")
	}
	plugs := slices.DeleteFunc(slices.Clone(f.hook.calls), func(c string) bool { return !strings.HasPrefix(c, "plug") })
	if len(plugs) != 2 || plugs[1] != "plug guests/vm-0 a claim-a" {
		t.Errorf("plug calls %q", plugs)
	}
}

// First-UID reuse: a new volume whose entry sorts after a removed one still
// listed is looked up in the removed one's pod, fails with HotplugFailed and
// is mounted only once the removed entry is gone; from v1.9.0 each entry
// uses its own pod. On v1.5 the failure fails the whole pass.
func TestFirstUIDReuse(t *testing.T) {
	for _, tc := range []struct {
		version        string
		waits, failing bool
	}{{"v1.5.3", true, true}, {"v1.6.3", true, false}, {"v1.7.0", true, false}, {"v1.8.4", true, false}, {"v1.9.0", false, false}, {"main", false, false}} {
		t.Run(tc.version, func(t *testing.T) {
			f := newFixture(t, tc.version)
			f.attached("pod-1", "a")
			f.remove("a")
			f.settle()
			f.wantPhase("a", kubevirtv1.HotplugVolumeUnMounted) // listed while pod-1 lives
			f.pods = append(f.pods, Pod{UID: "pod-2", Volumes: []string{"b"}})
			f.add("b", "pod-2")
			res := f.pass()
			if !tc.waits {
				f.wantPhase("b", kubevirtv1.HotplugVolumeMounted)
				return
			}
			f.wantPhase("b", kubevirtv1.HotplugVolumeAttachedToNode)
			if tc.failing != (res.Err != nil) || tc.failing == hasEvent(res.Events, ReasonHotplugFailed) {
				t.Fatalf("pass %+v: want failing=%v", res, tc.failing)
			}
			f.settle()
			f.wantPhase("b", kubevirtv1.HotplugVolumeAttachedToNode)
			f.drop("a") // pod-1 gone
			f.pass()
			f.wantPhase("b", kubevirtv1.HotplugVolumeMounted)
		})
	}
}

// The remount deadlock (kubevirt PR 18044): two removed volumes of one old
// pod are unmounted in the pass that unplugs them, whose status still shows
// their targets; the next pass mounts the first again from the old pod and
// fails on the second, whose device vanished, before Unmount. The first
// stays mounted and Ready, so virt-controller keeps the pod, every pass.
// main skips removed volumes and both end UnMountedFromPod.
func TestRemountDeadlock(t *testing.T) {
	for _, tc := range []struct {
		version string
		stuck   bool
	}{{"v1.6.3", true}, {"v1.7.0", true}, {"v1.8.4", true}, {"v1.9.0", true}, {"main", false}} {
		t.Run(tc.version, func(t *testing.T) {
			f := newFixture(t, tc.version)
			f.attached("pod-1", "a", "b")
			f.h.Faults().SetDeviceVanished("guests/vm-0", "b", true)
			f.remove("a", "b")
			for range 20 {
				f.pass()
				f.now = f.now.Add(5 * time.Minute) // past any I/O-error delay
			}
			if !tc.stuck {
				f.wantPhase("a", kubevirtv1.HotplugVolumeUnMounted)
				f.wantPhase("b", kubevirtv1.HotplugVolumeUnMounted)
				return
			}
			f.wantPhase("a", kubevirtv1.VolumeReady)
			if !f.h.Mounted(f.vmi.UID, "a") || f.last.Err == nil || !strings.Contains(f.last.Err.Error(), "no device in") {
				t.Fatalf("a mounted %v, last pass %+v", f.h.Mounted(f.vmi.UID, "a"), f.last)
			}
		})
	}
}

// Unmount stopping at the first failing path leaves the later removed
// volumes mounted (and Ready) until the first one unmounts; from v1.9.0 the
// others go.
func TestUnmountStopsAtFirstFailure(t *testing.T) {
	for _, tc := range []struct {
		version string
		stops   bool
	}{{"v1.5.3", true}, {"v1.7.0", true}, {"v1.8.4", true}, {"v1.9.0", false}, {"main", false}} {
		t.Run(tc.version, func(t *testing.T) {
			f := newFixture(t, tc.version)
			f.attached("pod-1", "a", "b")
			f.h.Faults().SetUnmountFails("guests/vm-0", "a", true)
			f.remove("a", "b")
			f.settle()
			f.wantPhase("a", kubevirtv1.VolumeReady)
			if tc.stops {
				f.wantPhase("b", kubevirtv1.VolumeReady)
			} else {
				f.wantPhase("b", kubevirtv1.HotplugVolumeUnMounted)
			}
			f.h.Faults().SetUnmountFails("guests/vm-0", "a", false)
			f.settle()
			f.wantPhase("a", kubevirtv1.HotplugVolumeUnMounted)
			f.wantPhase("b", kubevirtv1.HotplugVolumeUnMounted)
		})
	}
}

// A domain paused on an I/O error has its updates delayed 10 s, 20 s, 40 s
// ... up to 3 min (FailRetryManager, the same in every tag): each try goes
// through once its wait is over, and the next pass within 30 s waits again.
func TestIOErrorDelays(t *testing.T) {
	for _, version := range []string{"v1.5.3", "v1.7.0", "main"} {
		t.Run(version, func(t *testing.T) {
			f := newFixture(t, version)
			f.attached("pod-1", "a")
			f.h.Faults().SetDeviceVanished("guests/vm-0", "a", true)
			if res := f.pass(); res.Entries == nil {
				t.Fatal("the first paused pass was delayed")
			}
			var got []time.Duration
			for range 7 {
				res := f.pass()
				if res.Entries != nil {
					t.Fatalf("a pass within the window went through: %+v", res)
				}
				got = append(got, res.Wake)
				f.now = f.now.Add(res.Wake) // the try itself goes through
				if f.pass().Entries == nil {
					t.Fatal("the try after the wait was delayed")
				}
			}
			want := []time.Duration{9, 19, 39, 79, 159, 179, 179}
			for i := range want {
				want[i] *= time.Second
			}
			if !slices.Equal(got, want) {
				t.Errorf("delays %v, want %v", got, want)
			}
			f.h.Faults().SetDeviceVanished("guests/vm-0", "a", false)
			if f.pass().Entries == nil {
				t.Error("delayed after the device came back")
			}
		})
	}
}

// A set change that resets the entry of a disk the domain just attached
// (MountedToPod in the status, the target not yet written) detaches the
// disk again; the stale target then writes Ready, and the next pass
// attaches it once more. The converter and the domain sync are the same in
// every tag.
func TestResetEntryDetachesItsDisk(t *testing.T) {
	for _, version := range []string{"v1.5.3", "v1.7.0", "main"} {
		t.Run(version, func(t *testing.T) {
			f := newFixture(t, version)
			f.pods = []Pod{{UID: "pod-1", Volumes: []string{"a"}}}
			f.add("a", "pod-1")
			f.pass()
			f.pass() // the domain takes the disk; the status still says MountedToPod
			f.wantPhase("a", kubevirtv1.HotplugVolumeMounted)
			// virt-controller: a set change, no current pod.
			i := slices.IndexFunc(f.vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == "a" })
			f.vmi.Status.VolumeStatus[i].Phase = kubevirtv1.VolumeBound
			f.vmi.Status.VolumeStatus[i].HotplugVolume.AttachPodUID = ""
			f.hook.calls = nil
			f.pass()
			f.wantPhase("a", kubevirtv1.VolumeReady) // the target the pass began with
			f.pass()
			want := []string{"unplug guests/vm-0 a", "plug guests/vm-0 a claim-a"}
			if !slices.Equal(f.hook.calls, want) {
				t.Fatalf("hook calls %q, want %q", f.hook.calls, want)
			}
		})
	}
}

// hookLog is a disk hook that records its calls and fails while fail is set.
type hookLog struct {
	calls []string
	fail  bool
}

func (h *hookLog) Plug(_ context.Context, vm, volume, claim string) error {
	h.calls = append(h.calls, fmt.Sprintf("plug %s %s %s", vm, volume, claim))
	if h.fail {
		return errors.New("not yet")
	}
	return nil
}

func (h *hookLog) Unplug(_ context.Context, vm, volume string) error {
	h.calls = append(h.calls, fmt.Sprintf("unplug %s %s", vm, volume))
	if h.fail {
		return errors.New("busy")
	}
	return nil
}

func TestDriveLetters(t *testing.T) {
	for i, want := range map[int]string{0: "a", 25: "z", 26: "aa", 27: "ab", 701: "zz", 702: "aaa"} {
		if got := driveLetters(i); got != want {
			t.Errorf("driveLetters(%d) = %q, want %q", i, got, want)
		}
	}
}

// A domain paused on an I/O error shows in the VMI's Paused condition,
// which the hotplug queue reads as a device that may be gone; the
// condition goes once the device is back.
func TestPausedOnIOErrorCondition(t *testing.T) {
	f := newFixture(t, "v1.7.0")
	f.attached("pod-1", "a")
	if f.pass().PausedIOError {
		t.Fatal("paused before any device vanished")
	}
	f.h.Faults().SetDeviceVanished("guests/vm-0", "a", true)
	res := f.pass()
	if !res.PausedIOError {
		t.Fatalf("pass %+v: want the domain paused on an I/O error", res)
	}
	conds := PausedCondition(nil, res.PausedIOError, f.now)
	if len(conds) != 1 || conds[0].Type != kubevirtv1.VirtualMachineInstancePaused || conds[0].Reason != ReasonPausedIOError {
		t.Fatalf("conditions %+v: want one Paused condition for the I/O error", conds)
	}
	if again := PausedCondition(conds, true, f.now.Add(time.Second)); len(again) != 1 || !again[0].LastTransitionTime.Equal(&conds[0].LastTransitionTime) {
		t.Fatalf("a second paused pass changed the condition: %+v", again)
	}
	f.h.Faults().SetDeviceVanished("guests/vm-0", "a", false)
	f.now = f.now.Add(5 * time.Minute)
	if res := f.pass(); res.PausedIOError {
		t.Fatalf("pass %+v: still paused with the device back", res)
	}
	if left := PausedCondition(conds, false, f.now); len(left) != 0 {
		t.Fatalf("conditions %+v after the device came back", left)
	}
}
