package hotplug

import (
	"context"
	"strconv"
	"strings"

	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Strategy is how the queue orders and groups its writes to one VM so as not
// to lead a KubeVirt release into a wedge of its own making. Each rule
// answers a bug of virt-handler's hotplug mount loop; a rule that is off
// writes as if every release were fixed. docs/architecture.md ("Strategy
// per KubeVirt release") has the table.
type Strategy struct {
	// Name says which release the strategy was picked for, for logs and
	// docs ("safe" when the release is unknown).
	Name string
	// OneRemovalAtATime writes at most one removal of a mounted volume of a
	// VM at a time while the VMI is paused on an I/O error: the next only
	// once virt-handler has let go of the previous one (its entry left Ready
	// and MountedToPod, or the VMI). Every
	// tag up to v1.9.0 mounts removed volumes again from their old
	// attachment pod on each pass (v1.7.0 pkg/virt-handler/hotplug-disk/
	// mount.go:330-352, fixed on main by kubevirt PR 18044): with two
	// removals of one VM Ready at once and the second's device gone, the
	// first is mounted again and the pass fails on the second before
	// Unmount, on every pass, so the first stays Ready and the pod stays for
	// good. An entry virt-handler already wrote UnMountedFromPod cannot be
	// the one held: being mounted again does not bring a removed volume back
	// to Ready or MountedToPod (v1.7.0 pkg/virt-handler/vm.go:443-450, 474-506; Ready
	// needs a disk in the domain, MountedToPod a volume in the spec), and
	// only those two phases make virt-controller keep the pod
	// (pkg/virt-controller/watch/vmi/volume-hotplug.go:98-111, 122-131). So the
	// rule holds the next removal for two virt-handler passes, not for an
	// attachment-pod cycle. The same split keeps v1.5-v1.8's Unmount, which
	// stops at its first failing path (v1.7.0 mount.go:696-712, fixed in
	// v1.9.0 by PR 16742), from holding every later removal behind one that
	// fails: that one stays Ready.
	//
	// The deadlock needs a device gone from under its attachment pod (a
	// Longhorn volume faulted or detached), and a plugged disk losing its
	// device pauses the domain (KubeVirt's disks stop on errors), which
	// virt-handler writes as the VMI's Paused condition, reason
	// PausedIOError. Only then is the rule applied: on a healthy VM the
	// removals go together, since one at a time paces them by KubeVirt's
	// settling cycles, one removal per attachment-pod cycle, fewer than a
	// busy VM is asked for (the Harvester 1.8 lab profile's CronJobs held
	// detaches for minutes). What is left uncovered: a device that vanishes
	// after its disk was unplugged, with another removal of the VM still
	// Ready; the wedge detection reports it.
	OneRemovalAtATime bool
}

// StrategyAuto names the strategy the queue picks itself: SafeStrategy's
// rules until the backend reports the host's KubeVirt version, then
// StrategyFor that version.
const StrategyAuto = "auto"

// AutoStrategy is the default: see StrategyAuto.
func AutoStrategy() Strategy {
	s := SafeStrategy()
	s.Name = StrategyAuto
	return s
}

// kubeVirtVersioner is a backend that learned the host's KubeVirt version
// in Start ("" when it could not).
type kubeVirtVersioner interface {
	KubeVirtVersion() string
}

// pickStrategy replaces an automatic strategy by the one of the KubeVirt
// release the backend found. It runs before the workers start, the only
// readers of the strategy.
func (q *Queue) pickStrategy(ctx context.Context) {
	if q.cfg.Strategy.Name != StrategyAuto {
		return
	}
	version := ""
	if v, ok := q.backend.(kubeVirtVersioner); ok {
		version = v.KubeVirtVersion()
	}
	if version != "" {
		q.cfg.Strategy = StrategyFor(version)
	}
	klog.FromContext(ctx).Info("hotplug strategy", "kubevirtVersion", version, "strategy", q.cfg.Strategy.Name,
		"oneRemovalAtATime", q.cfg.Strategy.OneRemovalAtATime)
}

// SafeStrategy is every rule on: right for every shipped KubeVirt release
// and Harvester 1.6 to 1.9, and what the queue uses when it does not know
// the release.
func SafeStrategy() Strategy {
	return Strategy{Name: "safe", OneRemovalAtATime: true}
}

// StrategyFor picks the rules a KubeVirt version needs: "v1.7.0", "1.8.4",
// or "main" (kubevirt main with PR 18044). An empty or unparsable version
// gets SafeStrategy.
func StrategyFor(version string) Strategy {
	if version == "main" {
		return Strategy{Name: "kubevirt-main"}
	}
	parts := strings.SplitN(strings.TrimPrefix(version, "v"), ".", 3)
	if len(parts) < 2 || parts[0] != "1" {
		return SafeStrategy()
	}
	minor, err := strconv.Atoi(parts[1])
	if err != nil || minor < 5 {
		return SafeStrategy()
	}
	// Every 1.x release up to v1.9.0 remounts removed volumes, but only
	// from 1.6 does virt-controller keep an old attachment pod until its
	// volumes are unmounted (v1.7.0 pkg/virt-controller/watch/vmi/
	// volume-hotplug.go:74-122), which the remount then holds for good; 1.5
	// deletes it once the new pod runs (v1.5.3 pkg/virt-controller/watch/
	// vmi/vmi.go:1695, :2107), so the deadlock cannot form there. First-UID
	// reuse (up to 1.8) needs no rule: an add looked up in a removed
	// volume's old attachment pod misses only until virt-controller deletes
	// that pod, and with it the entry (docs/architecture.md).
	if minor == 5 {
		return Strategy{Name: "kubevirt-" + version}
	}
	return Strategy{Name: "kubevirt-" + version, OneRemovalAtATime: true}
}

// limitRemovals keeps, of the removals decided for a VM, the first of a
// volume mounted from a pod, and none while another such removal is in
// flight, and marks the rest as queued behind it. A removal is in flight from
// our write until KubeVirt took it and virt-handler moved the entry out of
// Ready and MountedToPod (Strategy.OneRemovalAtATime says why that is
// enough). A removal of a volume not mounted from a pod (a withdrawn add
// request, an entry not mounted yet: mountedFromPod) is never held: only
// mounted volumes can be mounted again.
func (p *plan) limitRemovals(o observed, pending map[string]bool, w *vmWork, removes []Change) []Change {
	// With first-UID reuse a removed entry is looked up in the first
	// entry's pod, not its own, so two removed entries of different pods
	// can deadlock the same way: one at a time per VM.
	busy := ""
	if o.vmi != nil {
		for _, e := range o.vmi.Status.VolumeStatus {
			if !mountedFromPod(&e) {
				continue
			}
			addReq, removeReq := o.requested(e.Name)
			writing := pending[e.Name] && w.expect[e.Name].op == Detach
			// KubeVirt has taken the removal once the VMI spec lacks the
			// volume; a volume only the VMI has (hot-plugged into the VMI
			// alone) is not being removed.
			taken := !o.inVMISpec(e.Name) && !addReq
			// Until KubeVirt takes it the entry may still move on to
			// MountedToPod and Ready; once taken, only those hold the pod.
			holding := !taken || e.Phase == kubevirtv1.VolumeReady || e.Phase == kubevirtv1.HotplugVolumeMounted
			if (removeReq || writing || taken) && holding && busy == "" {
				busy = e.Name
			}
		}
	}
	kept := removes[:0:0]
	for _, c := range removes {
		if !onPod(o, c.Volume) {
			kept = append(kept, c)
			continue
		}
		if busy != "" {
			p.waits[c.Volume] = waitFor{why: "queued: removing one mounted volume of the VM at a time, behind " + busy + " (KubeVirt mounts removed volumes again: kubevirt PR 18044)"}
			continue
		}
		busy = c.Volume
		kept = append(kept, c)
	}
	return kept
}

// onPod reports whether the volume is, or may be, mounted from an
// attachment pod: only then can a removal of it be mounted again.
func onPod(o observed, vol string) bool {
	e := o.status(vol)
	return e != nil && mountedFromPod(e)
}

// mountedFromPod reports whether a hotplug entry names an attachment pod or
// says its device is in virt-launcher (MountedToPod, Ready). The pod UID
// alone does not tell: while the pod that replaces a VM's attachment pod
// starts, virt-controller clears the UID of every entry in the spec, mounted
// ones included (kubevirt v1.7.0 pkg/virt-controller/watch/vmi/
// storage.go:202, v1.5.3 vmi/vmi.go:2068, v1.8.2 storage.go:189), and a
// removal written then still finds the device mounted from the old pod.
func mountedFromPod(e *kubevirtv1.VolumeStatus) bool {
	if e.HotplugVolume == nil {
		return false
	}
	return e.HotplugVolume.AttachPodUID != "" || e.Phase == kubevirtv1.HotplugVolumeMounted || e.Phase == kubevirtv1.VolumeReady
}
