package hotplug

import (
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/types"
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
	// OneRemovalPerPod writes at most one removal per attachment pod of a VM
	// at a time, and the next only once the VMI no longer lists the previous
	// one. Every tag up to v1.9.0 mounts removed volumes again from their old
	// attachment pod on each pass (v1.7.0 pkg/virt-handler/hotplug-disk/
	// mount.go:330-352, fixed on main by kubevirt PR 18044): with two
	// removals of one pod in flight and the second's device gone, the first
	// is mounted again and the pass fails on the second before Unmount, on
	// every pass, so the first stays Ready and the pod stays for good. The
	// same split keeps v1.5-v1.8's Unmount, which stops at its first failing
	// path (v1.7.0 mount.go:696-712, fixed in v1.9.0 by PR 16742), from
	// holding every later removal behind one that fails.
	OneRemovalPerPod bool
}

// SafeStrategy is every rule on: right for every shipped KubeVirt release
// and Harvester 1.6 to 1.9, and what the queue uses when it does not know
// the release.
func SafeStrategy() Strategy { return Strategy{Name: "safe", OneRemovalPerPod: true} }

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
	if _, err := strconv.Atoi(parts[1]); err != nil {
		return SafeStrategy()
	}
	// Every 1.x release up to v1.9.0 remounts removed volumes.
	return Strategy{Name: "kubevirt-" + version, OneRemovalPerPod: true}
}

// limitRemovalsPerPod keeps, of the removals decided for a VM, only those
// whose attachment pod has no other removal in flight or earlier in the
// list, and marks the rest as queued behind it. A removal of a volume the
// VMI has no pod for (a withdrawn add request, an entry not mounted yet)
// is never held: only a pod's mounted volumes can be mounted again.
func (p *plan) limitRemovalsPerPod(o observed, pending map[string]bool, w *vmWork, removes []Change) []Change {
	busy := map[types.UID]string{} // pod -> volume whose removal is in flight
	if o.vmi != nil {
		for _, e := range o.vmi.Status.VolumeStatus {
			if e.HotplugVolume == nil || e.HotplugVolume.AttachPodUID == "" {
				continue
			}
			addReq, removeReq := o.requested(e.Name)
			writing := pending[e.Name] && w.expect[e.Name].op == Detach
			written := o.vm != nil && !o.inVMSpec(e.Name) && !addReq
			if removeReq || writing || written {
				busy[e.HotplugVolume.AttachPodUID] = e.Name
			}
		}
	}
	kept := removes[:0:0]
	for _, c := range removes {
		s := o.status(c.Volume)
		if s == nil || s.HotplugVolume == nil || s.HotplugVolume.AttachPodUID == "" {
			kept = append(kept, c)
			continue
		}
		pod := s.HotplugVolume.AttachPodUID
		if first, ok := busy[pod]; ok {
			p.waits[c.Volume] = waitFor{why: fmt.Sprintf("queued: removing one volume at a time from attachment pod %s, behind %s (KubeVirt mounts removed volumes again from their old pod: kubevirt PR 18044)", pod, first)}
			continue
		}
		busy[pod] = c.Volume
		kept = append(kept, c)
	}
	return kept
}
