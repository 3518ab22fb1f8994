package host

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	kubevirtv1 "kubevirt.io/api/core/v1"
	kvfake "kubevirt.io/client-go/kubevirt/fake"
)

// lhVolume is a Longhorn Volume as longhorn-manager v1.10.1 writes it, in
// its JSON field names.
func lhVolume(name string, spec, status map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "longhorn.io/v1beta2", "kind": "Volume",
		"metadata": map[string]any{"name": name, "namespace": LonghornNamespace},
		"spec":     spec, "status": status,
	}}
}

// lhAttachment is the volume's Longhorn VolumeAttachment with one ticket per
// node: satisfied, or waiting with a condition message.
func lhAttachment(volume string, tickets map[string]string) *unstructured.Unstructured {
	specs, statuses := map[string]any{}, map[string]any{}
	for node, waiting := range tickets {
		id := "csi-" + node
		specs[id] = map[string]any{"id": id, "type": "csi-attacher", "nodeID": node, "generation": int64(1)}
		st := map[string]any{"id": id, "satisfied": waiting == "", "generation": int64(1)}
		if waiting != "" {
			st["conditions"] = []any{map[string]any{"type": "Satisfied", "status": "False", "message": waiting}}
		}
		statuses[id] = st
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "longhorn.io/v1beta2", "kind": "VolumeAttachment",
		"metadata": map[string]any{"name": volume, "namespace": LonghornNamespace},
		"spec":     map[string]any{"volume": volume, "attachmentTickets": specs},
		"status":   map[string]any{"attachmentTicketStatuses": statuses},
	}}
}

func boundClaim(name, pv string) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{VolumeName: pv}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
}

func csiPV(name, driver, handle string) *corev1.PersistentVolume {
	return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PersistentVolumeSpec{
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: handle}}}}
}

func runningVMI(vm, node string) *kubevirtv1.VirtualMachineInstance {
	return &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: vm},
		Status: kubevirtv1.VirtualMachineInstanceStatus{Phase: kubevirtv1.Running, NodeName: node}}
}

func storageHost(kubeObjs []runtime.Object, lh ...runtime.Object) (*Client, *kubefake.Clientset, *dynfake.FakeDynamicClient) {
	kube := kubefake.NewClientset(kubeObjs...)
	dyn := dynfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		LonghornVolumeResource: "VolumeList", LonghornAttachmentResource: "VolumeAttachmentList",
	}, lh...)
	kv := kvfake.NewSimpleClientset(runningVMI("vm-a", "host-b"))
	return &Client{Namespace: "guests", Kube: kube, KubeVirt: kv, Dynamic: dyn}, kube, dyn
}

func kinds(issues []StorageIssue) []string {
	var out []string
	for _, i := range issues {
		out = append(out, i.Kind)
	}
	return out
}

// TestStorageIssuesLonghorn: each state of the claim's Longhorn volume, as
// ControllerGetVolume and diagnose see it through the PV's volume handle.
// vm-a runs on host node host-b.
func TestStorageIssuesLonghorn(t *testing.T) {
	scheduledFalse := []any{map[string]any{"type": "Scheduled", "status": "False", "reason": "ReplicaSchedulingFailure", "message": "insufficient storage"}}
	for _, c := range []struct {
		name    string
		spec    map[string]any
		status  map[string]any
		tickets map[string]string
		want    []string
		say     []string // in the message
	}{
		{"healthy on the VM's node", map[string]any{"nodeID": "host-b", "accessMode": "rwx", "migratable": true},
			map[string]any{"state": "attached", "robustness": "healthy", "currentNodeID": "host-b"}, nil, nil, nil},
		{"faulted", map[string]any{"nodeID": "", "accessMode": "rwx", "migratable": true},
			map[string]any{"state": "detached", "robustness": "faulted"}, map[string]string{"host-b": "volume is faulted"},
			[]string{LonghornNotReady}, []string{"lh-1 is not ready for workloads", "faulted", "csi-host-b on host-b waiting: volume is faulted"}},
		{"no schedulable replica", map[string]any{"accessMode": "rwx", "migratable": true},
			map[string]any{"state": "detached", "robustness": "unknown", "conditions": scheduledFalse}, nil,
			[]string{LonghornNotReady}, []string{"cannot be scheduled", "insufficient storage"}},
		{"still attached elsewhere", map[string]any{"nodeID": "host-a", "accessMode": "rwx", "migratable": true},
			map[string]any{"state": "attached", "robustness": "healthy", "currentNodeID": "host-a"},
			map[string]string{"host-a": "", "host-b": "waiting for volume to detach from host-a"},
			[]string{LonghornElsewhere}, []string{"still attached on host node host-a", "VM vm-a runs on host node host-b", "csi-host-a on host-a satisfied"}},
		{"migrating", map[string]any{"nodeID": "host-a", "migrationNodeID": "host-b", "accessMode": "rwx", "migratable": true},
			map[string]any{"state": "attached", "robustness": "healthy", "currentNodeID": "host-a", "currentMigrationNodeID": "host-b"}, nil,
			[]string{LonghornMigrating}, []string{"migrating from host node host-a to host-b", "engine ready"}},
		{"share-manager RWX: anywhere", map[string]any{"nodeID": "host-c", "accessMode": "rwx", "migratable": false},
			map[string]any{"state": "attached", "robustness": "healthy", "currentNodeID": "host-c"}, nil, nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			lh := []runtime.Object{lhVolume("lh-1", c.spec, c.status)}
			if c.tickets != nil {
				lh = append(lh, lhAttachment("lh-1", c.tickets))
			}
			hc, _, _ := storageHost([]runtime.Object{csiPV("pv-1", LonghornProvisioner, "lh-1")}, lh...)
			issues, err := NewStorageReader(hc).Issues(context.Background(), StorageQuery{Claim: boundClaim("pvc-1", "pv-1"), Holders: []string{"vm-a"}})
			if err != nil {
				t.Fatal(err)
			}
			if got := kinds(issues); !slices.Equal(got, c.want) {
				t.Fatalf("issues %v, want kinds %v", issues, c.want)
			}
			for _, s := range c.say {
				if !strings.Contains(issues[0].Message, s) {
					t.Errorf("message %q does not say %q", issues[0].Message, s)
				}
			}
		})
	}
}

// TestStorageIssuesSkipped: a read the identity may not make, a host without
// Longhorn and a PV of another driver leave the Longhorn part out, without
// an error.
func TestStorageIssuesSkipped(t *testing.T) {
	faulted := lhVolume("lh-1", map[string]any{}, map[string]any{"state": "detached", "robustness": "faulted"})
	forbid := func(verb, resource string) func(*k8stesting.Fake) {
		return func(f *k8stesting.Fake) {
			f.PrependReactor(verb, resource, func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: resource}, "", nil)
			})
		}
	}
	for _, c := range []struct {
		name          string
		pv            *corev1.PersistentVolume
		lh            []runtime.Object
		kube, dynamic func(*k8stesting.Fake)
		refused       []string
	}{
		{"PV read refused", csiPV("pv-1", LonghornProvisioner, "lh-1"), []runtime.Object{faulted}, forbid("get", "persistentvolumes"), nil, []string{readPV}},
		{"Longhorn read refused", csiPV("pv-1", LonghornProvisioner, "lh-1"), []runtime.Object{faulted}, nil, forbid("get", "volumes"), []string{readLonghorn}},
		{"no Longhorn on the host", csiPV("pv-1", LonghornProvisioner, "lh-1"), nil, nil, nil, nil},
		{"another driver's PV", csiPV("pv-1", "lvm.driver.harvesterhci.io", "lh-1"), []runtime.Object{faulted}, nil, nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			hc, kube, dyn := storageHost([]runtime.Object{c.pv}, c.lh...)
			if c.kube != nil {
				c.kube(&kube.Fake)
			}
			if c.dynamic != nil {
				c.dynamic(&dyn.Fake)
			}
			r := NewStorageReader(hc)
			for range 2 { // the second refusal is not logged again, and still no error
				issues, err := r.Issues(context.Background(), StorageQuery{Claim: boundClaim("pvc-1", "pv-1"), Holders: []string{"vm-a"}})
				if err != nil || len(issues) != 0 {
					t.Fatalf("Issues: %v, %v; want none and no error", issues, err)
				}
			}
			if got := r.Refused(); !slices.Equal(got, c.refused) {
				t.Errorf("reads refused %v, want %v", got, c.refused)
			}
		})
	}
}

// hpPod is KubeVirt's attachment pod of vm-a, controlled by its launcher.
func hpPod(name string, claims ...string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: name, Labels: map[string]string{"kubevirt.io": "hotplug-disk"},
		OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: "virt-launcher-vm-a", Controller: ptrTo(true)}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending}}
	for _, c := range claims {
		p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: c, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}}})
	}
	return p
}

// byVMI is an attachment pod controlled by the VMI itself, as the test
// kit's simulator makes them.
func byVMI(p *corev1.Pod, vm string) *corev1.Pod {
	p = p.DeepCopy()
	p.OwnerReferences = []metav1.OwnerReference{{Kind: "VirtualMachineInstance", Name: vm, Controller: ptrTo(true)}}
	return p
}

func event(kind, name, typ, reason, message string, at time.Time) *corev1.Event {
	return &corev1.Event{ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: name + "." + reason + at.Format("150405")},
		InvolvedObject: corev1.ObjectReference{Kind: kind, Name: name, Namespace: "guests"},
		Type:           typ, Reason: reason, Message: message, Count: 3, LastTimestamp: metav1.NewTime(at)}
}

// TestStorageIssuesAttachmentPods: why the attachment pod of a VM waiting for
// the volume does not run, from its status and Events, and KubeVirt's Event
// on the VMI when it could not create one.
func TestStorageIssuesAttachmentPods(t *testing.T) {
	now := time.Now()
	unschedulable := hpPod("hp-volume-cordoned", "pvc-1")
	unschedulable.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable,
		Message: "0/3 nodes are available: 1 node(s) were unschedulable, 2 node(s) didn't match Pod's node affinity/selector."}}
	creating := hpPod("hp-volume-creating", "pvc-1")
	creating.Spec.NodeName = "host-b"
	creating.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "hotplug-disk", State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}}}
	attachFailed := event("Pod", "hp-volume-creating", corev1.EventTypeWarning, "FailedAttachVolume",
		`AttachVolume.Attach failed for volume "pv-1" : rpc error: code = Aborted desc = volume lh-1 is not ready for workloads`, now)
	starting := hpPod("hp-volume-starting", "pvc-1")
	starting.Spec.NodeName = "host-b"
	otherVolume := hpPod("hp-volume-other", "pvc-other")
	otherVolume.Status.Phase = corev1.PodRunning
	quota := event("VirtualMachineInstance", "vm-a", corev1.EventTypeWarning, "FailedCreate",
		`Error creating attachment pod: pods "hp-volume-x" is forbidden: exceeded quota: guests, requested: limits.cpu=100m`, now.Add(-time.Minute))
	quotaOld := event("VirtualMachineInstance", "vm-a", corev1.EventTypeWarning, "FailedCreate", "Error creating attachment pod: older", now.Add(-time.Hour))
	launcher := launcherPod("virt-launcher-vm-a", "vm-a", corev1.PodRunning)
	for _, c := range []struct {
		name   string
		objs   []runtime.Object
		events bool // Events readable
		want   []string
		say    string
	}{
		{"unschedulable", []runtime.Object{launcher, unschedulable}, true, []string{AttachmentPodUnschedulable}, "1 node(s) were unschedulable"},
		{"unschedulable, Events refused", []runtime.Object{launcher, unschedulable}, false, []string{AttachmentPodUnschedulable}, "virt-launcher's tolerations"},
		{"volume not attached", []runtime.Object{launcher, creating, attachFailed}, true, []string{AttachmentPodVolumeWait}, "on host node host-b: FailedAttachVolume"},
		{"volume not attached, Events refused", []runtime.Object{launcher, creating, attachFailed}, false, nil, ""},
		{"starting", []runtime.Object{launcher, starting}, true, nil, ""},
		{"quota refusal", []runtime.Object{launcher, otherVolume, quotaOld, quota}, true, []string{AttachmentPodRefused}, "exceeded quota"},
		{"quota refusal, Events refused", []runtime.Object{launcher, otherVolume, quota}, false, nil, ""},
		{"another VM's pod", []runtime.Object{launcherPod("virt-launcher-vm-b", "vm-b", corev1.PodRunning), unschedulable}, true, nil, ""},
		{"controlled by the VMI", []runtime.Object{byVMI(unschedulable, "vm-a")}, true, []string{AttachmentPodUnschedulable}, "1 node(s) were unschedulable"},
	} {
		t.Run(c.name, func(t *testing.T) {
			hc, kube, _ := storageHost(c.objs)
			if !c.events {
				kube.PrependReactor("list", "events", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "events"}, "", nil)
				})
			}
			issues, err := NewStorageReader(hc).Issues(context.Background(),
				StorageQuery{Claim: boundClaim("pvc-1", ""), Holders: []string{"vm-a"}, Waiting: []string{"vm-a"}})
			if err != nil {
				t.Fatal(err)
			}
			if got := kinds(issues); !slices.Equal(got, c.want) {
				t.Fatalf("issues %v, want kinds %v", issues, c.want)
			}
			if c.say != "" && (!strings.Contains(issues[0].Message, c.say) || issues[0].VM != "vm-a") {
				t.Errorf("issue %+v does not name vm-a and say %q", issues[0], c.say)
			}
		})
	}
}

// A VM whose hotplug is done is not looked at: no pod or Event read.
func TestStorageIssuesReadPodsOnlyForWaitingVMs(t *testing.T) {
	hc, kube, _ := storageHost(nil)
	if _, err := NewStorageReader(hc).Issues(context.Background(), StorageQuery{Claim: boundClaim("pvc-1", ""), Holders: []string{"vm-a"}}); err != nil {
		t.Fatal(err)
	}
	for _, a := range kube.Actions() {
		t.Errorf("unexpected host read %s %s", a.GetVerb(), a.GetResource().Resource)
	}
}
