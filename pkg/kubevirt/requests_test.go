package kubevirt

import (
	"context"
	"reflect"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clienttesting "k8s.io/client-go/testing"
	kubevirtfake "kubevirt.io/client-go/kubevirt/fake"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// requestsVM is a VM with a root disk, a hot-plugged pvc-a, a volume named
// other on claim pvc-x, and an add of pvc-q queued.
func requestsVM() *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
		"metadata": map[string]any{"name": "vm1", "namespace": "ns"},
		"spec": map[string]any{"template": map[string]any{"spec": map[string]any{"volumes": []any{
			map[string]any{"name": "rootdisk", "containerDisk": map[string]any{"image": "x"}},
			hotplugVolume("pvc-a"),
			map[string]any{"name": "other", "persistentVolumeClaim": map[string]any{"claimName": "pvc-x", "hotpluggable": true}},
		}}}},
		"status": map[string]any{"volumeRequests": []any{
			map[string]any{"addVolumeOptions": map[string]any{"name": "pvc-q"}},
		}},
	}}
}

func requestsBackend(t *testing.T) (*Subresource, *dynamicfake.FakeDynamicClient, *kubevirtfake.Clientset) {
	t.Helper()
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{vmResource: "VirtualMachineList"}, requestsVM())
	kv := kubevirtfake.NewSimpleClientset()
	s := NewSubresource(&host.Client{Namespace: "ns", Dynamic: dyn, KubeVirt: kv})
	s.UseRequestList()
	return s, dyn, kv
}

func subresourceCalls(kv *kubevirtfake.Clientset) []string {
	var calls []string
	for _, a := range kv.Actions() {
		if a.GetSubresource() != "" {
			calls = append(calls, a.GetSubresource())
		}
	}
	return calls
}

// TestQueueRequestsChecksAsVirtAPIDoes: one patch queues the adds and
// removals that virt-api would queue, answers what is done or in flight
// without a write, and leaves to a call each what only virt-api words
// exactly.
func TestQueueRequestsChecksAsVirtAPIDoes(t *testing.T) {
	s, dyn, kv := requestsBackend(t)
	changes := []hotplug.Change{
		{Volume: "pvc-a", Op: hotplug.Attach},    // in the template
		{Volume: "pvc-q", Op: hotplug.Attach},    // queued
		{Volume: "pvc-new", Op: hotplug.Attach},  // written
		{Volume: "pvc-q", Op: hotplug.Detach},    // not in the template: a call
		{Volume: "rootdisk", Op: hotplug.Detach}, // not hotpluggable: a call
		{Volume: "pvc-x", Op: hotplug.Attach},    // claim under another name: a call
	}
	outs := s.Apply(context.Background(), "vm1", changes)
	want := []hotplug.Result{hotplug.AlreadyDone, hotplug.InFlight, hotplug.Applied, hotplug.Applied, hotplug.Applied, hotplug.Applied}
	for i, o := range outs {
		if o.Result != want[i] {
			t.Errorf("change %d (%s %s): %v (%v), want %v", i, changes[i].Op, changes[i].Volume, o.Result, o.Err, want[i])
		}
	}
	if got := subresourceCalls(kv); !reflect.DeepEqual(got, []string{"removevolume", "removevolume", "addvolume"}) {
		t.Errorf("virt-api calls %v, want removevolume of pvc-q and rootdisk, addvolume of pvc-x", got)
	}
	vm, err := dyn.Resource(vmResource).Namespace("ns").Get(context.Background(), "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	reqs, _, _ := unstructured.NestedSlice(vm.Object, "status", "volumeRequests")
	var names []string
	for _, r := range reqs {
		m := r.(map[string]any)
		if o, ok := m["addVolumeOptions"].(map[string]any); ok {
			names = append(names, "add:"+o["name"].(string))
		}
		if o, ok := m["removeVolumeOptions"].(map[string]any); ok {
			names = append(names, "remove:"+o["name"].(string))
		}
	}
	if !reflect.DeepEqual(names, []string{"add:pvc-q", "add:pvc-new"}) {
		t.Errorf("request list %v, want the queued add and the new one", names)
	}

	// A removal of a volume in the template replaces a queued add of it.
	s2, dyn2, _ := requestsBackend(t)
	if o := s2.Apply(context.Background(), "vm1", []hotplug.Change{{Volume: "pvc-a", Op: hotplug.Detach}}); o[0].Result != hotplug.Applied {
		t.Fatalf("removal of pvc-a: %v (%v)", o[0].Result, o[0].Err)
	}
	vm, _ = dyn2.Resource(vmResource).Namespace("ns").Get(context.Background(), "vm1", metav1.GetOptions{})
	reqs, _, _ = unstructured.NestedSlice(vm.Object, "status", "volumeRequests")
	if len(reqs) != 2 {
		t.Errorf("request list %v, want the queued add of pvc-q and the removal of pvc-a", reqs)
	}
}

// TestQueueRequestsFallsBackWhenForbidden: an identity that may not patch
// virtualmachines/status gets its changes made by virt-api calls, and the
// request list is not tried again.
func TestQueueRequestsFallsBackWhenForbidden(t *testing.T) {
	s, dyn, kv := requestsBackend(t)
	patches := 0
	dyn.PrependReactor("patch", "virtualmachines", func(clienttesting.Action) (bool, runtime.Object, error) {
		patches++
		return true, nil, apierrors.NewForbidden(vmResource.GroupResource(), "vm1", nil)
	})
	outs := s.Apply(context.Background(), "vm1", []hotplug.Change{{Volume: "pvc-new", Op: hotplug.Attach}})
	if outs[0].Result != hotplug.Applied {
		t.Fatalf("attach: %v (%v), want Applied through addvolume", outs[0].Result, outs[0].Err)
	}
	outs = s.Apply(context.Background(), "vm1", []hotplug.Change{{Volume: "pvc-b", Op: hotplug.Attach}})
	if outs[0].Result != hotplug.Applied {
		t.Fatalf("second attach: %v (%v)", outs[0].Result, outs[0].Err)
	}
	if patches != 1 {
		t.Errorf("%d status patches tried, want 1 (then none once forbidden)", patches)
	}
	if got := subresourceCalls(kv); !reflect.DeepEqual(got, []string{"addvolume", "addvolume"}) {
		t.Errorf("virt-api calls %v, want two addvolume", got)
	}
}
