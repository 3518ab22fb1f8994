package hotplug

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestViewFollowsTheInformers(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if got := q.View("vm-missing"); got.Exists || got.Running || len(got.Volumes) != 0 {
		t.Errorf("view of a VM that does not exist: %+v", got)
	}
	for _, vol := range []string{"pvc-b", "pvc-a"} {
		if err := q.Attach(ctx, "vm1", vol, true); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := q.View("vm1"), (VMView{Exists: true, Running: true, Guest: GuestRunning, Volumes: []string{"pvc-a", "pvc-b"}}); !reflect.DeepEqual(got, want) {
		t.Errorf("view %+v, want %+v", got, want)
	}
	// The VMI goes away (the VM stopped): not running, and the volumes are
	// still in the VM spec, so still the VM's to give back.
	if err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Delete(ctx, "vm1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "VMI gone", 5*time.Second, func() bool { v := q.View("vm1"); return !v.Running && v.Guest == GuestAbsent })
	if got := q.View("vm1").Volumes; !reflect.DeepEqual(got, []string{"pvc-a", "pvc-b"}) {
		t.Errorf("volumes of the stopped VM: %v", got)
	}
}

// Only a VMI that ended (or is being deleted) or no VMI at all can turn out
// to be a stopped guest; Unknown, paused and starting ones may run.
func TestGuestStateOf(t *testing.T) {
	vmi := func(phase kubevirtv1.VirtualMachineInstancePhase, deleting, paused bool) *kubevirtv1.VirtualMachineInstance {
		v := &kubevirtv1.VirtualMachineInstance{Status: kubevirtv1.VirtualMachineInstanceStatus{Phase: phase}}
		if deleting {
			v.DeletionTimestamp = &metav1.Time{}
		}
		if paused {
			v.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstancePaused, Status: corev1.ConditionTrue}}
		}
		return v
	}
	for _, tc := range []struct {
		vmi  *kubevirtv1.VirtualMachineInstance
		want GuestState
	}{
		{nil, GuestAbsent},
		{vmi(kubevirtv1.Running, false, false), GuestRunning},
		{vmi(kubevirtv1.Running, false, true), GuestMayRun},
		{vmi(kubevirtv1.Unknown, false, false), GuestMayRun},
		{vmi(kubevirtv1.Unknown, true, false), GuestMayRun},
		{vmi(kubevirtv1.Pending, false, false), GuestMayRun},
		{vmi(kubevirtv1.Scheduling, false, false), GuestMayRun},
		{vmi(kubevirtv1.Scheduled, false, false), GuestMayRun},
		{vmi(kubevirtv1.WaitingForSync, false, false), GuestMayRun},
		{vmi("", false, false), GuestMayRun},
		{vmi(kubevirtv1.Succeeded, false, false), GuestEnded},
		{vmi(kubevirtv1.Failed, false, false), GuestEnded},
		{vmi(kubevirtv1.Running, true, false), GuestEnded},
		{vmi(kubevirtv1.Running, true, true), GuestEnded},
	} {
		name := "none"
		if tc.vmi != nil {
			name = fmt.Sprintf("%q deleting=%v paused=%v", tc.vmi.Status.Phase, tc.vmi.DeletionTimestamp != nil, len(tc.vmi.Status.Conditions) > 0)
		}
		if got := GuestStateOf(tc.vmi); got != tc.want {
			t.Errorf("%s: %v, want %v", name, got, tc.want)
		}
	}
}

func TestLostListsOnlyADroppedHotplug(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	q, _ := startQueue(t, f, fastConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	attachAll(ctx, t, q, "vm1", "pvc-a", "pvc-b")
	if got := q.Lost("pvc-a"); len(got) != 0 {
		t.Fatalf("an attached volume is lost on %v", got)
	}
	// KubeVirt drops pvc-a from the running VMI; the VM spec keeps it.
	setVMI := func(mutate func(*kubevirtv1.VirtualMachineInstance)) {
		t.Helper()
		f.vmiMu.Lock()
		defer f.vmiMu.Unlock()
		vmi, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Get(ctx, "vm1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		mutate(vmi)
		if _, err := f.kv.KubevirtV1().VirtualMachineInstances(ns).Update(ctx, vmi, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setVMI(func(vmi *kubevirtv1.VirtualMachineInstance) {
		next := vmiWith(map[string]kubevirtv1.VolumePhase{"pvc-b": kubevirtv1.VolumeReady})
		vmi.Spec.Volumes, vmi.Status.VolumeStatus = next.Spec.Volumes, next.Status.VolumeStatus
	})
	testwait.For(t, "pvc-a lost", 5*time.Second, func() bool { return reflect.DeepEqual(q.Lost("pvc-a"), []string{"vm1"}) })
	if got := q.Lost("pvc-b"); len(got) != 0 {
		t.Errorf("pvc-b is still on the VMI but lost on %v", got)
	}
	// A VMI that does not run has lost nothing: the VM is stopped or starting.
	setVMI(func(vmi *kubevirtv1.VirtualMachineInstance) { vmi.Status.Phase = kubevirtv1.Scheduled })
	testwait.For(t, "VMI not running", 5*time.Second, func() bool { return !q.View("vm1").Running })
	if got := q.Lost("pvc-a"); len(got) != 0 {
		t.Errorf("lost on a VMI that does not run: %v", got)
	}
}
