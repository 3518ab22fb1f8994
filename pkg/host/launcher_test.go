package host

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	kubevirtv1 "kubevirt.io/api/core/v1"
	kvfake "kubevirt.io/client-go/kubevirt/fake"
)

func testVMI(phase kubevirtv1.VirtualMachineInstancePhase, deleting, paused bool) *kubevirtv1.VirtualMachineInstance {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: "vm-1", UID: "uid-1"},
		Status: kubevirtv1.VirtualMachineInstanceStatus{Phase: phase}}
	if deleting {
		vmi.DeletionTimestamp = &metav1.Time{}
		vmi.Finalizers = []string{"kubevirt.io/virtualMachineControllerFinalize"}
	}
	if paused {
		vmi.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstancePaused, Status: corev1.ConditionTrue}}
	}
	return vmi
}

// launcherPod is a virt-launcher pod as virt-controller makes it: labelled
// kubevirt.io=virt-launcher and controlled by its VMI.
func launcherPod(name, vmi string, phase corev1.PodPhase) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: name, Labels: map[string]string{kubevirtv1.AppLabel: "virt-launcher"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachineInstance", Name: vmi, UID: "uid-1", Controller: ptrTo(true)}}},
		Status: corev1.PodStatus{Phase: phase},
	}
}

func ptrTo[T any](v T) *T { return &v }

// Only a guest known to be stopped is: no VMI, or an ended VMI, and no
// virt-launcher pod of the VM whose containers may still run.
func TestGuestStopped(t *testing.T) {
	for _, tc := range []struct {
		name string
		vmi  *kubevirtv1.VirtualMachineInstance
		pods []*corev1.Pod
		want bool
	}{
		{name: "no VMI, no launcher pod", want: true},
		{name: "no VMI, a launcher pod of a VMI whose finalizer was removed", pods: []*corev1.Pod{launcherPod("virt-launcher-vm-1-x", "vm-1", corev1.PodRunning)}},
		{name: "Succeeded, launcher pod gone", vmi: testVMI(kubevirtv1.Succeeded, false, false), want: true},
		{name: "Failed, launcher pod finished", vmi: testVMI(kubevirtv1.Failed, false, false), pods: []*corev1.Pod{launcherPod("virt-launcher-vm-1-x", "vm-1", corev1.PodFailed)}, want: true},
		{name: "Failed, launcher pod still running", vmi: testVMI(kubevirtv1.Failed, false, false), pods: []*corev1.Pod{launcherPod("virt-launcher-vm-1-x", "vm-1", corev1.PodRunning)}},
		{name: "Succeeded, another VM's launcher pod runs", vmi: testVMI(kubevirtv1.Succeeded, false, false), pods: []*corev1.Pod{launcherPod("virt-launcher-vm-2-x", "vm-2", corev1.PodRunning)}, want: true},
		{name: "being deleted while Running, launcher pod terminating", vmi: testVMI(kubevirtv1.Running, true, false), pods: []*corev1.Pod{launcherPod("virt-launcher-vm-1-x", "vm-1", corev1.PodRunning)}},
		{name: "being deleted, launcher pod gone", vmi: testVMI(kubevirtv1.Running, true, false), want: true},
		{name: "Unknown (host lost the node), no launcher pod object", vmi: testVMI(kubevirtv1.Unknown, false, false)},
		{name: "Unknown and being deleted", vmi: testVMI(kubevirtv1.Unknown, true, false)},
		{name: "Running", vmi: testVMI(kubevirtv1.Running, false, false)},
		{name: "paused", vmi: testVMI(kubevirtv1.Running, false, true)},
		{name: "Scheduling", vmi: testVMI(kubevirtv1.Scheduling, false, false)},
		{name: "Scheduled", vmi: testVMI(kubevirtv1.Scheduled, false, false)},
		{name: "Pending", vmi: testVMI(kubevirtv1.Pending, false, false)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var kvObjs, kubeObjs []runtime.Object
			if tc.vmi != nil {
				kvObjs = append(kvObjs, tc.vmi)
			}
			for _, p := range tc.pods {
				kubeObjs = append(kubeObjs, p)
			}
			c := &Client{Namespace: "guests", Kube: kubefake.NewClientset(kubeObjs...), KubeVirt: kvfake.NewSimpleClientset(kvObjs...)}
			stopped, why, err := c.GuestStopped(context.Background(), "vm-1")
			if err != nil {
				t.Fatal(err)
			}
			if stopped != tc.want || why == "" {
				t.Errorf("stopped = %v (%q), want %v", stopped, why, tc.want)
			}
		})
	}
}

// A refused pod read is an error the caller can tell apart, never "stopped".
func TestGuestStoppedWithoutPodRead(t *testing.T) {
	kube := kubefake.NewClientset()
	kube.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", errors.New("no grant"))
	})
	c := &Client{Namespace: "guests", Kube: kube, KubeVirt: kvfake.NewSimpleClientset()}
	stopped, _, err := c.GuestStopped(context.Background(), "vm-1")
	if stopped || !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "vm-1") {
		t.Errorf("stopped %v, err %v: want not stopped and a Forbidden error naming the VM", stopped, err)
	}
}

// The live read of one VMI's launcher pods names, by UID, those created for
// that VMI (its created-by label) whose containers may still run.
func TestLiveLaunchersOfOneVMI(t *testing.T) {
	pod := func(name, createdBy string, phase corev1.PodPhase) *corev1.Pod {
		p := launcherPod(name, "vm-1", phase)
		p.UID = types.UID("pod-" + name)
		p.Labels[kubevirtv1.CreatedByLabel] = createdBy
		return p
	}
	c := &Client{Namespace: "guests", KubeVirt: kvfake.NewSimpleClientset(), Kube: kubefake.NewClientset(
		pod("source", "uid-1", corev1.PodSucceeded), // a migration's source that ended
		pod("current", "uid-1", corev1.PodRunning),
		pod("target", "uid-1", corev1.PodPending),  // the next migration's target
		pod("earlier", "uid-0", corev1.PodRunning), // an earlier VMI of the VM
	)}
	live, err := c.LiveLaunchers(context.Background(), "vm-1", "uid-1")
	if err != nil {
		t.Fatal(err)
	}
	want := map[types.UID]bool{"pod-current": true, "pod-target": true}
	if !maps.Equal(live, want) {
		t.Errorf("live launchers %v, want %v", live, want)
	}
}
