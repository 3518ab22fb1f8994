package kubevirt

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
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
	c *host.Client

	// A batch needs the VM's two lists exactly as stored. What our last
	// patch of a VM stored is in the patch's answer; while the VM cache
	// shows the VM with that UID and generation (a VM's generation moves
	// with its spec only, not with virt-controller's status writes), the
	// lists are still those and the next batch needs no read. Anything else
	// (no answer kept, a cache behind or ahead, another writer of the spec)
	// reads the VM, and the patch's `test` operations stay the guard either
	// way: lists that changed in between fail the patch, which is retried
	// after a read.
	vms  cache.Store
	mu   sync.Mutex
	kept map[string]keptLists
}

type keptLists struct {
	uid                   types.UID
	generation            int64
	vols, disks           []any
	volsFound, disksFound bool
}

// NewDeclarative returns the declarative backend. vms, the VM informer's
// store (nil: none), lets Apply take a VM's lists from its own last patch
// while the store shows the VM unchanged since.
func NewDeclarative(c *host.Client, vms cache.Store) *Declarative {
	return &Declarative{c: c, vms: vms, kept: map[string]keptLists{}}
}

// keptFor returns the lists our last patch of vm stored, if the cache
// shows the VM's spec unchanged since.
func (d *Declarative) keptFor(vm string) (keptLists, bool) {
	if d.vms == nil {
		return keptLists{}, false
	}
	d.mu.Lock()
	k, ok := d.kept[vm]
	d.mu.Unlock()
	if !ok {
		return keptLists{}, false
	}
	obj, exists, err := d.vms.GetByKey(d.c.Namespace + "/" + vm)
	m, isObj := obj.(metav1.Object)
	if err != nil || !exists || !isObj || m.GetUID() != k.uid || m.GetGeneration() != k.generation {
		d.forget(vm)
		return keptLists{}, false
	}
	return k, true
}

func (d *Declarative) forget(vm string) {
	d.mu.Lock()
	delete(d.kept, vm)
	d.mu.Unlock()
}

// keep remembers the lists of a VM as a patch answer stored them.
func (d *Declarative) keep(vm string, obj *unstructured.Unstructured) {
	k, err := listsOf(obj)
	if d.vms == nil || err != nil || k.generation == 0 {
		d.forget(vm)
		return
	}
	d.mu.Lock()
	d.kept[vm] = k
	d.mu.Unlock()
}

// listsOf takes a stored VM's volume and disk lists, raw, with its UID and
// generation.
func listsOf(obj *unstructured.Unstructured) (keptLists, error) {
	k := keptLists{uid: obj.GetUID(), generation: obj.GetGeneration()}
	var err error
	if k.vols, k.volsFound, err = unstructured.NestedSlice(obj.Object, "spec", "template", "spec", "volumes"); err != nil {
		return k, err
	}
	k.disks, k.disksFound, err = unstructured.NestedSlice(obj.Object, "spec", "template", "spec", "domain", "devices", "disks")
	return k, err
}

// Name names the path in logs and metrics.
func (d *Declarative) Name() string { return "declarative" }

// Apply makes one attempt at the changes (hotplug.Backend's Apply).
func (d *Declarative) Apply(ctx context.Context, vm string, changes []hotplug.Change) []hotplug.Outcome {
	outs := make([]hotplug.Outcome, len(changes))
	fill := func(o hotplug.Outcome) []hotplug.Outcome {
		for i := range outs {
			outs[i] = o
		}
		return outs
	}
	k, ok := d.keptFor(vm)
	if !ok {
		// Read raw JSON, not typed objects: the test values must match the
		// stored lists byte for byte in meaning, including fields this
		// build of the KubeVirt API does not know.
		obj, err := d.c.Dynamic.Resource(vmResource).Namespace(d.c.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			return fill(classify(err, hotplug.Attach))
		}
		if k, err = listsOf(obj); err != nil {
			return fill(hotplug.Outcome{Result: hotplug.Failed, Err: err})
		}
	}
	vols, volsFound, disks, disksFound := k.vols, k.volsFound, k.disks, k.disksFound

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
	stored, err := d.c.Dynamic.Resource(vmResource).Namespace(d.c.Namespace).Patch(ctx, vm, types.JSONPatchType, body, metav1.PatchOptions{})
	if err == nil {
		d.keep(vm, stored)
	} else {
		d.forget(vm)
	}
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
	set := "replace"
	if !found {
		set = "add"
	}
	return []map[string]any{testValue(path, old, found), {"op": set, "path": path, "value": updated}}
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
