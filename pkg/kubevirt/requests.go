package kubevirt

import (
	"context"
	"encoding/json"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

const requestsPath = "/status/volumeRequests"

// queueRequests puts a batch of changes into the VM's status.volumeRequests
// with one patch, the write virt-api's addvolume and removevolume make for
// one request each on a KubeVirt with the legacy gate (kubevirt v1.5.3
// pkg/virt-api/rest/subresource.go vmVolumePatchStatus; v1.6.3
// pkg/virt-api/rest/volumes.go:252-275). KubeVirt's VM controller works the
// list off in order whoever wrote it, and KubeVirt's and Harvester's
// admission webhooks judge this write as they judge virt-api's.
//
// Why not virt-api: up to v1.6.3 virt-api has 5 requests per second, burst
// 10, for its own reads and writes (pkg/virt-config/virt-config.go:87-88),
// and every call costs two of them; the VM controller's call on the VMI for
// each request costs two more from the same budget. Under churn that budget,
// not KubeVirt's work, sets the pace. One patch per batch spends none of it.
//
// It applies virt-api's checks to what it reads (verifyVolumeOption and the
// request-list checks): an add of a volume the template has is already done,
// a request already queued for a volume is in flight, and a remove drops a
// queued add of the same volume. Changes whose answer only virt-api words
// exactly (a claim under another volume name, a volume that is not
// hotpluggable, a remove of a volume not in the template, which remove()
// handles) are left to a call each: their indexes come back in perCall, as
// do all of them when the write is refused for a reason one call each can
// tell apart (a webhook's denial, the disk limit) or is forbidden, which
// turns this path off.
func (s *Subresource) queueRequests(ctx context.Context, vm string, changes []hotplug.Change) (outs []hotplug.Outcome, perCall []int) {
	outs = make([]hotplug.Outcome, len(changes))
	all := func(o hotplug.Outcome) ([]hotplug.Outcome, []int) {
		for i := range outs {
			outs[i] = o
		}
		return outs, nil
	}
	// Raw JSON, as the declarative path reads it: the test values must
	// match the stored lists, fields this build does not know included.
	obj, err := s.c.Dynamic.Resource(vmResource).Namespace(s.c.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		return all(classify(err, hotplug.Attach))
	}
	vols, volsFound, err := unstructured.NestedSlice(obj.Object, "spec", "template", "spec", "volumes")
	if err != nil {
		return all(hotplug.Outcome{Result: hotplug.Failed, Err: err})
	}
	reqs, reqsFound, err := unstructured.NestedSlice(obj.Object, "status", "volumeRequests")
	if err != nil {
		return all(hotplug.Outcome{Result: hotplug.Failed, Err: err})
	}

	updated := clone(reqs)
	var written []int
	for i, ch := range changes {
		addQueued, removeQueued := queuedFor(updated, ch.Volume)
		inTemplate := indexByName(vols, ch.Volume)
		switch {
		case ch.Op == hotplug.Attach && inTemplate >= 0:
			outs[i] = hotplug.Outcome{Result: hotplug.AlreadyDone}
		case ch.Op == hotplug.Attach && claimedElsewhere(vols, ch.Volume):
			perCall = append(perCall, i)
		case ch.Op == hotplug.Attach && (addQueued || removeQueued):
			outs[i] = hotplug.Outcome{Result: hotplug.InFlight, Err: fmt.Errorf("a request for volume %s is queued on VM %s", ch.Volume, vm)}
		case ch.Op == hotplug.Attach:
			r, err := requestObject(kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: addVolumeOptions(ch.Volume)})
			if err != nil {
				return all(hotplug.Outcome{Result: hotplug.Failed, Err: err})
			}
			updated = append(updated, r)
			written = append(written, i)
		case inTemplate < 0, !isHotpluggable(vols[inTemplate]):
			perCall = append(perCall, i)
		case removeQueued:
			outs[i] = hotplug.Outcome{Result: hotplug.InFlight, Err: fmt.Errorf("a removal of volume %s is queued on VM %s", ch.Volume, vm)}
		default:
			r, err := requestObject(kubevirtv1.VirtualMachineVolumeRequest{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: ch.Volume}})
			if err != nil {
				return all(hotplug.Outcome{Result: hotplug.Failed, Err: err})
			}
			updated = append(withoutAddRequest(updated, ch.Volume), r)
			written = append(written, i)
		}
	}
	if len(written) == 0 {
		return outs, perCall
	}

	// The checks above read the template's volumes and the request list:
	// both are guarded, so a write that moved either fails the patch.
	patch := []map[string]any{testValue(volumesPath, vols, volsFound)}
	patch = append(patch, guardAndSet(requestsPath, reqs, reqsFound, updated)...)
	body, err := json.Marshal(patch)
	if err != nil {
		return all(hotplug.Outcome{Result: hotplug.Failed, Err: err})
	}
	_, err = s.c.Dynamic.Resource(vmResource).Namespace(s.c.Namespace).Patch(ctx, vm, types.JSONPatchType, body, metav1.PatchOptions{}, "status")
	o := classify(err, hotplug.Attach)
	switch {
	case apierrors.IsForbidden(err):
		s.direct.Store(false)
		klog.FromContext(ctx).Info("the host identity may not patch virtualmachines/status: hot-plugs go through virt-api's addvolume and removevolume, one call each", "vm", vm, "err", err)
		return outs, append(perCall, written...)
	case o.Result == hotplug.Rejected:
		return outs, append(perCall, written...)
	case o.Result == hotplug.VMGone && !apierrors.IsNotFound(err):
		o.Result = hotplug.Failed
	}
	for _, i := range written {
		outs[i] = o
	}
	return outs, perCall
}

// queuedFor reports whether an add or a remove of volume is queued.
func queuedFor(reqs []any, volume string) (add, remove bool) {
	for _, r := range reqs {
		m, _ := r.(map[string]any)
		if o, ok := m["addVolumeOptions"].(map[string]any); ok && o["name"] == volume {
			add = true
		}
		if o, ok := m["removeVolumeOptions"].(map[string]any); ok && o["name"] == volume {
			remove = true
		}
	}
	return add, remove
}

// withoutAddRequest drops a queued add of volume, as virt-api does when it
// queues the volume's removal.
func withoutAddRequest(reqs []any, volume string) []any {
	out := make([]any, 0, len(reqs))
	for _, r := range reqs {
		m, _ := r.(map[string]any)
		if o, ok := m["addVolumeOptions"].(map[string]any); ok && o["name"] == volume {
			continue
		}
		out = append(out, r)
	}
	return out
}

// claimedElsewhere reports a template volume of another name on the claim:
// virt-api refuses that add ("Unable to add volume source").
func claimedElsewhere(vols []any, claim string) bool {
	for _, v := range vols {
		m, _ := v.(map[string]any)
		if m["name"] == claim {
			continue
		}
		if pvc, ok := m["persistentVolumeClaim"].(map[string]any); ok && pvc["claimName"] == claim {
			return true
		}
		if dv, ok := m["dataVolume"].(map[string]any); ok && dv["name"] == claim {
			return true
		}
	}
	return false
}

func requestObject(r kubevirtv1.VirtualMachineVolumeRequest) (map[string]any, error) {
	return runtime.DefaultUnstructuredConverter.ToUnstructured(&r)
}

// testValue tests that a list is still what we read; an absent list is
// tested as null, which JSON patch treats as "missing".
func testValue(path string, old []any, found bool) map[string]any {
	if !found {
		return map[string]any{"op": "test", "path": path, "value": nil}
	}
	return map[string]any{"op": "test", "path": path, "value": old}
}
