package host

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

var vmResource = schema.GroupVersionResource{Group: "kubevirt.io", Version: "v1", Resource: "virtualmachines"}

const (
	volumesPath = "/spec/template/spec/volumes"
	disksPath   = "/spec/template/spec/domain/devices/disks"
)

// Declarative hot-plugs by editing the VM spec, which KubeVirt's
// DeclarativeHotplugVolumes controller carries over to the VMI. All pending
// changes of a VM go into one JSON patch guarded by `test` operations on the
// two lists it replaces: unlike a resourceVersion guard, virt-controller's
// status writes between our read and our patch do not fail it.
type Declarative struct {
	c *Client
}

// NewDeclarative returns the declarative backend.
func NewDeclarative(c *Client) *Declarative { return &Declarative{c: c} }

// Name implements hotplug.Backend.
func (d *Declarative) Name() string { return "declarative" }

// Apply implements hotplug.Backend.
func (d *Declarative) Apply(ctx context.Context, vm string, changes []hotplug.Change) []hotplug.Outcome {
	outs := make([]hotplug.Outcome, len(changes))
	fill := func(o hotplug.Outcome) []hotplug.Outcome {
		for i := range outs {
			outs[i] = o
		}
		return outs
	}
	// Read raw JSON, not typed objects: the test values must match the stored
	// lists byte for byte in meaning, including fields this build of the
	// KubeVirt API does not know.
	obj, err := d.c.Dynamic.Resource(vmResource).Namespace(d.c.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		return fill(classify(err, hotplug.Attach))
	}
	vols, volsFound, err := unstructured.NestedSlice(obj.Object, "spec", "template", "spec", "volumes")
	if err != nil {
		return fill(hotplug.Outcome{Result: hotplug.Failed, Err: err})
	}
	disks, disksFound, err := unstructured.NestedSlice(obj.Object, "spec", "template", "spec", "domain", "devices", "disks")
	if err != nil {
		return fill(hotplug.Outcome{Result: hotplug.Failed, Err: err})
	}

	newVols, newDisks := vols, disks
	var touched []int
	for i, ch := range changes {
		hasVol, hasDisk := indexByName(newVols, ch.Volume) >= 0, indexByName(newDisks, ch.Volume) >= 0
		switch {
		case ch.Op == hotplug.Attach && hasVol && hasDisk, ch.Op == hotplug.Detach && !hasVol && !hasDisk:
			outs[i] = hotplug.Outcome{Result: hotplug.AlreadyDone}
			continue
		case ch.Op == hotplug.Attach:
			if !hasVol {
				newVols = append(clone(newVols), hotplugVolume(ch.Volume))
			}
			if !hasDisk {
				newDisks = append(clone(newDisks), hotplugDisk(ch.Volume))
			}
		default:
			if v := indexByName(newVols, ch.Volume); v >= 0 && !isHotpluggable(newVols[v]) {
				outs[i] = hotplug.Outcome{Result: hotplug.Rejected, Err: fmt.Errorf("volume %s is not hotpluggable", ch.Volume)}
				continue
			}
			newVols, newDisks = withoutName(newVols, ch.Volume), withoutName(newDisks, ch.Volume)
		}
		touched = append(touched, i)
	}
	if len(touched) == 0 {
		return outs
	}

	patch := []map[string]any{}
	patch = append(patch, guardAndSet(volumesPath, vols, volsFound, newVols)...)
	patch = append(patch, guardAndSet(disksPath, disks, disksFound, newDisks)...)
	body, err := json.Marshal(patch)
	if err != nil {
		return fill(hotplug.Outcome{Result: hotplug.Failed, Err: err})
	}
	_, err = d.c.Dynamic.Resource(vmResource).Namespace(d.c.Namespace).Patch(ctx, vm, types.JSONPatchType, body, metav1.PatchOptions{})
	o := classify(err, hotplug.Attach)
	if o.Result == hotplug.Rejected && len(touched) > 1 {
		// A webhook refused the batch: find the volumes it refuses by trying
		// each alone, so one bad volume does not hold back the rest.
		for _, i := range touched {
			outs[i] = d.Apply(ctx, vm, changes[i:i+1])[0]
		}
		return outs
	}
	if o.Result == hotplug.VMGone && !apierrors.IsNotFound(err) {
		o.Result = hotplug.Failed
	}
	for _, i := range touched {
		outs[i] = o
	}
	return outs
}

// guardAndSet tests that a list is still what we read, then sets it. An
// absent list is tested as null, which JSON patch treats as "missing".
func guardAndSet(path string, old []any, found bool, updated []any) []map[string]any {
	if updated == nil {
		updated = []any{}
	}
	if !found {
		return []map[string]any{
			{"op": "test", "path": path, "value": nil},
			{"op": "add", "path": path, "value": updated},
		}
	}
	return []map[string]any{
		{"op": "test", "path": path, "value": old},
		{"op": "replace", "path": path, "value": updated},
	}
}

func hotplugVolume(name string) any {
	return map[string]any{
		"name":                  name,
		"persistentVolumeClaim": map[string]any{"claimName": name, "hotpluggable": true},
	}
}

func hotplugDisk(name string) any {
	return map[string]any{"name": name, "disk": map[string]any{"bus": "scsi"}}
}

func isHotpluggable(v any) bool {
	m, _ := v.(map[string]any)
	for _, src := range []string{"persistentVolumeClaim", "dataVolume"} {
		if s, ok := m[src].(map[string]any); ok {
			h, _ := s["hotpluggable"].(bool)
			return h
		}
	}
	return false
}

func indexByName(list []any, name string) int {
	for i, e := range list {
		if m, ok := e.(map[string]any); ok && m["name"] == name {
			return i
		}
	}
	return -1
}

func withoutName(list []any, name string) []any {
	out := make([]any, 0, len(list))
	for _, e := range list {
		if m, ok := e.(map[string]any); ok && m["name"] == name {
			continue
		}
		out = append(out, e)
	}
	return out
}

func clone(list []any) []any { return append([]any(nil), list...) }

func corePVCSource(claim string) corev1.PersistentVolumeClaimVolumeSource {
	return corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}
}
