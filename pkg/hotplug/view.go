package hotplug

import (
	"slices"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// VMView is what the informers show of one VM, for callers that act on the
// guest behind it (the guest node monitor). Like Holders and Published it is
// read from the caches, never from memory of this process.
type VMView struct {
	// Exists says the VM object is in the cache.
	Exists bool
	// Running says the VM's VMI runs: phase Running, not being deleted
	// and not paused.
	Running bool
	// Guest is what the VMI in the cache says of the guest behind the VM;
	// only GuestAbsent and GuestEnded can turn out to be a stopped guest.
	Guest GuestState
	// Volumes lists the volumes of this driver (hot-plugged claims named
	// after their claim) that the VM spec, a queued legacy request, the
	// VMI spec or the VMI status still has, sorted.
	Volumes []string
}

// View reads one VM from the informers.
func (q *Queue) View(vm string) VMView {
	o := q.observe(q.key(vm))
	v := VMView{Exists: o.vm != nil, Running: o.running(), Guest: GuestStateOf(o.vmi)}
	seen := map[string]bool{}
	add := func(name string, claim *kubevirtv1.PersistentVolumeClaimVolumeSource) {
		if claim != nil && claim.Hotpluggable && claim.ClaimName == name && !seen[name] {
			seen[name] = true
			v.Volumes = append(v.Volumes, name)
		}
	}
	if o.vm != nil {
		if o.vm.Spec.Template != nil {
			for _, vol := range o.vm.Spec.Template.Spec.Volumes {
				add(vol.Name, vol.PersistentVolumeClaim)
			}
		}
		for _, r := range o.vm.Status.VolumeRequests {
			if a := r.AddVolumeOptions; a != nil && a.VolumeSource != nil {
				add(a.Name, a.VolumeSource.PersistentVolumeClaim)
			}
		}
	}
	if o.vmi != nil {
		for _, vol := range o.vmi.Spec.Volumes {
			add(vol.Name, vol.PersistentVolumeClaim)
		}
		for _, st := range o.vmi.Status.VolumeStatus {
			// A status entry outlives its spec entry while KubeVirt
			// unplugs it; only hotplug entries of a claim of the same name
			// are this driver's.
			if st.HotplugVolume != nil && (st.PersistentVolumeClaimInfo == nil || st.PersistentVolumeClaimInfo.ClaimName == st.Name) && !seen[st.Name] {
				seen[st.Name] = true
				v.Volumes = append(v.Volumes, st.Name)
			}
		}
	}
	slices.Sort(v.Volumes)
	return v
}

// GuestState sorts a VMI by whether its guest may still run.
type GuestState int

const (
	// GuestAbsent: there is no VMI. KubeVirt keeps a VMI (its finalizer)
	// until every pod it controls is deleted (kubevirt v1.7.0
	// pkg/virt-controller/watch/vmi/lifecycle.go, allPodsDeleted), so no
	// guest runs unless someone removed that finalizer by hand.
	GuestAbsent GuestState = iota
	// GuestRunning: phase Running, not paused, not being deleted.
	GuestRunning
	// GuestMayRun: the guest may be alive or about to be: phase Unknown
	// (the host lost contact with the VMI's node, the guest may still
	// run there), paused (it resumes where it stopped), or not yet
	// running (Pending, Scheduling, Scheduled, WaitingForSync, unset).
	GuestMayRun
	// GuestEnded: phase Succeeded or Failed, or the VMI is being deleted:
	// the guest is stopped once the VMI's virt-launcher pod is gone too.
	GuestEnded
)

func (s GuestState) String() string {
	switch s {
	case GuestAbsent:
		return "no VMI"
	case GuestRunning:
		return "running"
	case GuestMayRun:
		return "may be running"
	default:
		return "ended"
	}
}

// GuestStateOf sorts a VMI (nil: none). Unknown wins over a deletion: a VMI
// whose node the host lost keeps its launcher pod object until that node is
// dealt with, and the guest may run on behind it.
func GuestStateOf(vmi *kubevirtv1.VirtualMachineInstance) GuestState {
	switch {
	case vmi == nil:
		return GuestAbsent
	case vmi.Status.Phase == kubevirtv1.Unknown:
		return GuestMayRun
	case vmi.DeletionTimestamp != nil || vmi.IsFinal():
		return GuestEnded
	case (observed{vmi: vmi}).running():
		return GuestRunning
	default:
		return GuestMayRun
	}
}

// Lost lists the VMs whose spec holds the volume as a finished hotplug while
// their running VMI has dropped it (no spec entry, no status entry), and that
// this process is not changing: KubeVirt lost the hotplug behind the
// driver's back (harvester 10588). A VM that is stopped or still starting
// has not lost anything.
func (q *Queue) Lost(volume string) []string {
	var out []string
	objs, _ := q.vms.ByIndex(indexClaim, volume)
	for _, obj := range objs {
		vm, ok := obj.(*kubevirtv1.VirtualMachine)
		if !ok {
			continue
		}
		key := q.key(vm.Name)
		o := q.observe(key)
		if !o.inVMSpec(volume) || !o.diskInVMSpec(volume) || !o.running() {
			continue
		}
		if add, remove := o.requested(volume); add || remove {
			continue
		}
		if o.inVMISpec(volume) || o.status(volume) != nil {
			continue
		}
		q.mu.Lock()
		w := q.work[key]
		busy := w != nil && (w.intents[volume] != nil || hasKey(w.expect, volume))
		q.mu.Unlock()
		if !busy {
			out = append(out, vm.Name)
		}
	}
	slices.Sort(out)
	return out
}

func hasKey[V any](m map[string]V, k string) bool {
	_, ok := m[k]
	return ok
}

// running reports whether the VMI runs a guest: phase Running, not being
// deleted and not paused. A VMI that runs but is not Ready (a failing
// readiness probe) still runs a guest that may write to its disks.
func (o observed) running() bool {
	if o.vmi == nil || o.vmi.DeletionTimestamp != nil || o.vmi.Status.Phase != kubevirtv1.Running {
		return false
	}
	for _, c := range o.vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstancePaused && c.Status == corev1.ConditionTrue {
			return false
		}
	}
	return true
}
