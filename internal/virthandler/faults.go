package virthandler

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Faults are the host faults virt-handler meets, per VM ("namespace/name")
// and volume.
type Faults struct {
	mu       sync.Mutex
	vanish   map[string]bool // vm/volume
	unmountF map[string]bool // vm/volume
}

func newFaults() *Faults {
	return &Faults{vanish: map[string]bool{}, unmountF: map[string]bool{}}
}

// SetDeviceVanished makes the volume's block device vanish from under its
// attachment pod (a Longhorn volume that faulted or was detached under a
// running pod), or come back. A domain with the disk plugged pauses on an
// I/O error (KubeVirt's disks default to error policy stop), which delays
// the VMI's updates; mounting the volume from its pod fails with "no device
// in" (mount.go:103), an error virt-handler does not tolerate.
func (f *Faults) SetDeviceVanished(vm, volume string, on bool) {
	f.set(f.vanish, vm, volume, on)
}

// SetUnmountFails makes virt-handler's unmount of the volume's path fail
// (its cgroup device rule cannot be removed), or succeed again.
func (f *Faults) SetUnmountFails(vm, volume string, on bool) {
	f.set(f.unmountF, vm, volume, on)
}

func (f *Faults) set(m map[string]bool, vm, volume string, on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if on {
		m[vm+"/"+volume] = true
	} else {
		delete(m, vm+"/"+volume)
	}
}

func (f *Faults) vanished(vm, volume string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.vanish[vm+"/"+volume]
}

func (f *Faults) unmountFails(vm, volume string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.unmountF[vm+"/"+volume]
}

// ioRetry is virt-handler's io-error-retry FailRetryManager for one VMI
// (v1.7.0 pkg/virt-handler/retry_manager.go:83 ShouldDelay): the first
// paused pass goes through; one within the response window of the last
// try waits until the next try, and each try doubles the wait.
type ioRetry struct {
	nextRun, lastRun time.Time
	wait             time.Duration
	lastRunFailed    bool
}

// pausedOnIOError: a disk the domain has plugged lost its device, and the
// guest's next I/O to it pauses the domain (error policy stop).
func (p *pass) pausedOnIOError() bool {
	for name := range p.d.targets {
		if p.h.faults.vanished(p.key, name) {
			return true
		}
	}
	return false
}

// PausedCondition is the VMI's conditions with the Paused condition
// virt-handler writes for a domain paused on an I/O error (v1.7.0
// pkg/virt-handler/vm.go:1161-1170), added while paused and dropped once
// the domain runs again (the same in every tag).
func PausedCondition(conds []kubevirtv1.VirtualMachineInstanceCondition, paused bool, now time.Time) []kubevirtv1.VirtualMachineInstanceCondition {
	i := slices.IndexFunc(conds, func(c kubevirtv1.VirtualMachineInstanceCondition) bool {
		return c.Type == kubevirtv1.VirtualMachineInstancePaused
	})
	switch {
	case paused && i < 0:
		t := metav1.NewTime(now)
		return append(slices.Clone(conds), kubevirtv1.VirtualMachineInstanceCondition{
			Type: kubevirtv1.VirtualMachineInstancePaused, Status: corev1.ConditionTrue,
			LastProbeTime: t, LastTransitionTime: t,
			Reason: ReasonPausedIOError, Message: "VMI was paused, low-level IO error detected",
		})
	case !paused && i >= 0 && conds[i].Reason == ReasonPausedIOError:
		return slices.Delete(slices.Clone(conds), i, i+1)
	}
	return conds
}

// ReasonPausedIOError is the Paused condition's reason for an I/O error.
const ReasonPausedIOError = "PausedIOError"

// ioErrorDelay reports whether this pass of a domain paused (or not) on an
// I/O error is delayed, and for how long.
func (p *pass) ioErrorDelay(paused bool) (time.Duration, bool) {
	r, t, now := &p.d.io, p.h.t, p.now
	if !paused {
		return 0, false
	}
	switch {
	case r.nextRun.IsZero() || (!r.lastRunFailed && !now.Before(r.lastRun.Add(t.IOErrorWindow))):
		*r = ioRetry{lastRun: now, nextRun: now.Add(t.IOErrorWait), wait: t.IOErrorWait}
		return 0, false
	case !r.lastRunFailed:
		r.lastRunFailed = true
		if now.Before(r.nextRun) {
			return r.nextRun.Sub(now), true
		}
		return 0, false
	case now.Before(r.nextRun) || now.Equal(r.nextRun):
		return max(r.nextRun.Sub(now), time.Millisecond), true
	}
	r.wait = min(2*r.wait, t.IOErrorMaxWait)
	r.nextRun, r.lastRun, r.lastRunFailed = now.Add(r.wait), now, false
	return 0, false
}

// Phase is updateHotplugVolumeStatus (v1.7.0 pkg/virt-handler/vm.go:474,
// the same in every tag): a target (the domain has the disk) means Ready
// whatever the phase was; otherwise a mounted volume in the spec becomes
// MountedToPod and an unmounted one out of the spec UnMountedFromPod, each
// only from the phases its guard allows (vm.go:443 canUpdateToMounted, :447
// canUpdateToUnmounted).
func Phase(e *kubevirtv1.VolumeStatus, inSpec, mounted bool) {
	switch {
	case e.Target != "":
		e.Phase, e.Reason = kubevirtv1.VolumeReady, "VolumeReady"
		e.Message = fmt.Sprintf("Successfully attach hotplugged volume %s to VM", e.Name)
	case mounted && inSpec && canUpdateToMounted(e.Phase):
		e.Phase, e.Reason = kubevirtv1.HotplugVolumeMounted, "VolumeMountedToPod"
		e.Message = fmt.Sprintf("Volume %s has been mounted in virt-launcher pod", e.Name)
	case !mounted && !inSpec && canUpdateToUnmounted(e.Phase):
		e.Phase, e.Reason = kubevirtv1.HotplugVolumeUnMounted, "VolumeUnMountedFromPod"
		e.Message = fmt.Sprintf("Volume %s has been unmounted from virt-launcher pod", e.Name)
	}
}

func canUpdateToMounted(p kubevirtv1.VolumePhase) bool {
	return p == kubevirtv1.VolumeBound || p == kubevirtv1.VolumePending || p == kubevirtv1.HotplugVolumeAttachedToNode
}

func canUpdateToUnmounted(p kubevirtv1.VolumePhase) bool {
	return p == kubevirtv1.VolumeReady || p == kubevirtv1.HotplugVolumeMounted || p == kubevirtv1.HotplugVolumeAttachedToNode
}

// claimOf is the PVC behind a VMI volume (a DataVolume's claim has its name).
func claimOf(vols []kubevirtv1.Volume, name string) string {
	for _, v := range vols {
		if v.Name != name {
			continue
		}
		switch {
		case v.PersistentVolumeClaim != nil:
			return v.PersistentVolumeClaim.ClaimName
		case v.DataVolume != nil:
			return v.DataVolume.Name
		}
	}
	return name
}

// nextTarget picks the first free sdX name (vdX on virtio) for the disk,
// as the domain names hot-plugged disks.
func nextTarget(vmi *kubevirtv1.VirtualMachineInstance, name string, used map[string]bool) string {
	for _, e := range vmi.Status.VolumeStatus {
		if e.Target != "" && e.HotplugVolume == nil {
			used[e.Target] = true
		}
	}
	prefix := "sd"
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		if d.Name == name && d.Disk != nil && d.Disk.Bus == kubevirtv1.DiskBusVirtio {
			prefix = "vd"
		}
	}
	return FreeTarget(prefix, used)
}

// FreeTarget takes the first disk name prefix+a, prefix+b, ... that used
// lacks, marks it used and returns it: the kernel's naming of the disks a
// domain has, which virt-controller follows for a new volume's target too.
func FreeTarget(prefix string, used map[string]bool) string {
	for i := 0; ; i++ {
		t := prefix + driveLetters(i)
		if !used[t] {
			used[t] = true
			return t
		}
	}
}

// driveLetters is the kernel's disk suffix: a..z, aa..az, ...
func driveLetters(i int) string {
	s := ""
	for i++; i > 0; i = (i - 1) / 26 {
		s = string(rune('a'+(i-1)%26)) + s
	}
	return s
}

func sortedKeys(m map[string]string) []string {
	keys := slices.Collect(maps.Keys(m))
	slices.Sort(keys)
	return keys
}
