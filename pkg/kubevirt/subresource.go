package kubevirt

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync/atomic"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Subresource hot-plugs on a KubeVirt whose legacy HotplugVolumes gate is
// on: through virt-api's addvolume/removevolume on the VM, one call at a
// time (the queue already serializes per VM), or, once Start has read the
// gate from the KubeVirt CR and while the host identity may, by queueing a
// whole batch in the VM's status.volumeRequests with one patch
// (queueRequests). It is the only path that works while the legacy gate is
// on.
type Subresource struct {
	c *host.Client
	// direct says queueRequests may write the batch; set only when the
	// KubeVirt CR shows the legacy gate (the VM controller works the list
	// off only then), cleared for good by a Forbidden answer.
	direct atomic.Bool
}

// NewSubresource returns the subresource backend, one call per change
// until UseRequestList is called.
func NewSubresource(c *host.Client) *Subresource { return &Subresource{c: c} }

// UseRequestList lets the backend queue a batch in status.volumeRequests
// itself; call it only for a KubeVirt whose legacy gate is on.
func (s *Subresource) UseRequestList() { s.direct.Store(true) }

// Name names the path in logs and metrics.
func (s *Subresource) Name() string { return "subresource" }

// Apply makes one attempt at the changes (hotplug.Backend's Apply).
func (s *Subresource) Apply(ctx context.Context, vm string, changes []hotplug.Change) []hotplug.Outcome {
	outs := make([]hotplug.Outcome, len(changes))
	todo := make([]int, len(changes))
	for i := range todo {
		todo[i] = i
	}
	if s.direct.Load() {
		outs, todo = s.queueRequests(ctx, vm, changes)
		slices.Sort(todo)
	}
	vms := s.c.KubeVirt.KubevirtV1().VirtualMachines(s.c.Namespace)
	for n, i := range todo {
		ch := changes[i]
		if ch.Op == hotplug.Attach {
			outs[i] = classify(vms.AddVolume(ctx, vm, addVolumeOptions(ch.Volume)), ch.Op)
		} else {
			outs[i] = s.remove(ctx, vm, ch.Volume)
		}
		if outs[i].Result == hotplug.VMGone {
			for _, j := range todo[n+1:] {
				outs[j] = outs[i]
			}
			break
		}
	}
	return outs
}

// remove takes a volume off the VM. virt-api refuses to remove what is not
// in the VM spec, yet two states hold a volume that is not there: an add
// still queued in status.volumeRequests (the legacy controller never applied
// it, e.g. a webhook denied its spec update, and it blocks every request
// behind it), and a VMI that took the volume while the VM spec update failed.
// The first is withdrawn from the request list with the same compare-and-swap
// virt-api uses, the second is removed through the VMI.
func (s *Subresource) remove(ctx context.Context, vm, volume string) hotplug.Outcome {
	vms := s.c.KubeVirt.KubevirtV1().VirtualMachines(s.c.Namespace)
	o := classify(vms.RemoveVolume(ctx, vm, &kubevirtv1.RemoveVolumeOptions{Name: volume}), hotplug.Detach)
	if o.Result != hotplug.AlreadyDone {
		return o
	}
	cur, err := vms.Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		return classify(err, hotplug.Detach)
	}
	if kept, withdrawn := withoutAdd(cur.Status.VolumeRequests, volume); withdrawn {
		patch, err := requestsPatch(cur.Status.VolumeRequests, kept)
		if err != nil {
			return hotplug.Outcome{Result: hotplug.Failed, Err: err}
		}
		_, err = vms.Patch(ctx, vm, types.JSONPatchType, patch, metav1.PatchOptions{}, "status")
		return classify(err, hotplug.Detach)
	}
	vmi, err := s.c.KubeVirt.KubevirtV1().VirtualMachineInstances(s.c.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil || !hasVolumeNamed(vmi.Spec.Volumes, volume) {
		return o // the VMI is gone or never had it: really done
	}
	err = s.c.KubeVirt.KubevirtV1().VirtualMachineInstances(s.c.Namespace).RemoveVolume(ctx, vm, &kubevirtv1.RemoveVolumeOptions{Name: volume})
	if err != nil && strings.Contains(err.Error(), "is owned by a VM") {
		// Declarative KubeVirt: the VMI path is closed because its
		// controller takes the volume off the VMI by itself.
		return o
	}
	return classify(err, hotplug.Detach)
}

func withoutAdd(reqs []kubevirtv1.VirtualMachineVolumeRequest, volume string) (kept []kubevirtv1.VirtualMachineVolumeRequest, found bool) {
	kept = []kubevirtv1.VirtualMachineVolumeRequest{}
	for _, r := range reqs {
		if r.AddVolumeOptions != nil && r.AddVolumeOptions.Name == volume {
			found = true
			continue
		}
		kept = append(kept, r)
	}
	return kept, found
}

// requestsPatch replaces status.volumeRequests if it still equals old.
func requestsPatch(old, updated []kubevirtv1.VirtualMachineVolumeRequest) ([]byte, error) {
	return json.Marshal([]map[string]any{
		{"op": "test", "path": "/status/volumeRequests", "value": old},
		{"op": "replace", "path": "/status/volumeRequests", "value": updated},
	})
}

func hasVolumeNamed(vols []kubevirtv1.Volume, name string) bool {
	for _, v := range vols {
		if v.Name == name {
			return true
		}
	}
	return false
}

func addVolumeOptions(volume string) *kubevirtv1.AddVolumeOptions {
	return &kubevirtv1.AddVolumeOptions{
		Name: volume,
		Disk: &kubevirtv1.Disk{
			Name:       volume,
			DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}},
		},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corePVCSource(volume),
				Hotpluggable:                      true,
			},
		},
	}
}
