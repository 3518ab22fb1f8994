package realkubevirt

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// After virt-controller's hand-off the agents write the source and target
// virt-handler's steps one at a time, in KubeVirt's order: the target's
// address, the source's start, the target's domain, then (not while the
// transfer is held) the target's acknowledgement moving the VMI, completed,
// and the target label dropped, with the source virt-launcher ended.
func TestMigrationHandshakeInKubeVirtsOrder(t *testing.T) {
	ctx := context.Background()
	const ns, source, target = "guests", "harvester-0", "harvester-1"
	launcher := func(name, uid, node string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: types.UID("uid-" + name),
				Labels: map[string]string{kubevirtv1.AppLabel: launcherLabelValue, kubevirtv1.CreatedByLabel: uid}},
			Spec:   corev1.PodSpec{NodeName: node},
			Status: corev1.PodStatus{Phase: corev1.PodRunning, HostIP: "10.0.0." + node[len(node)-1:], ContainerStatuses: []corev1.ContainerStatus{{Name: "compute", Ready: true}}},
		}
	}
	src, tgt := launcher("virt-launcher-vm-src", "vmi-uid", source), launcher("virt-launcher-vm-tgt", "vmi-uid", target)
	hp := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "hp-volume-tgt", Namespace: ns, UID: "hp-tgt",
		Labels:          map[string]string{kubevirtv1.AppLabel: attachmentLabelValue},
		OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: tgt.Name, UID: tgt.UID}}},
		Spec: corev1.PodSpec{NodeName: target}}
	kube := fake.NewClientset(src, tgt, hp)
	a := testAgents(t, kube, []string{source, target}, src, tgt, hp)
	a.transferTime = 0
	vmi := &kubevirtv1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: ns, UID: "vmi-uid",
			Labels: map[string]string{kubevirtv1.NodeNameLabel: source, kubevirtv1.MigrationTargetNodeNameLabel: target}},
		Status: kubevirtv1.VirtualMachineInstanceStatus{Phase: kubevirtv1.Running, NodeName: source,
			MigrationState: &kubevirtv1.VirtualMachineInstanceMigrationState{
				MigrationUID: "mig-uid", SourceNode: source, TargetNode: target, TargetPod: tgt.Name, TargetAttachmentPodUID: hp.UID,
			}},
	}
	step := func(want string, check func() bool) {
		t.Helper()
		changed, _, err := a.syncMigration(ctx, vmi)
		if err != nil {
			t.Fatalf("%s: %v", want, err)
		}
		if !changed || !check() {
			t.Fatalf("step %q: changed %v, VMI labels %v status %+v", want, changed, vmi.Labels, vmi.Status.MigrationState)
		}
	}
	ms := vmi.Status.MigrationState
	step("target advertises its address", func() bool {
		return ms.TargetNodeAddress == "10.0.0.1" && len(ms.TargetDirectMigrationNodePorts) > 0 && ms.StartTimestamp == nil
	})
	step("source starts the transfer", func() bool {
		return ms.StartTimestamp != nil && ms.Mode == kubevirtv1.MigrationPreCopy && transferring(vmi)
	})
	step("target detects the domain", func() bool { return ms.TargetNodeDomainDetected && ms.EndTimestamp == nil })

	a.hold(ns, "vm", true)
	if changed, _, err := a.syncMigration(ctx, vmi); changed || err != nil || !transferring(vmi) {
		t.Fatalf("held transfer: changed %v, err %v, state %+v: want it still transferring", changed, err, ms)
	}
	a.hold(ns, "vm", false)
	step("target acknowledges the end", func() bool {
		return ms.EndTimestamp != nil && ms.TargetNodeDomainReadyTimestamp != nil && vmi.Status.NodeName == target &&
			vmi.Labels[kubevirtv1.NodeNameLabel] == target && vmi.Status.MigrationTransport == kubevirtv1.MigrationTransportUnix && !ms.Completed
	})
	step("target finalizes", func() bool { return ms.Completed && !ms.Failed })
	step("target cleans up", func() bool {
		_, labelled := vmi.Labels[kubevirtv1.MigrationTargetNodeNameLabel]
		return !labelled
	})
	if changed, _, err := a.syncMigration(ctx, vmi); changed || err != nil {
		t.Errorf("after the migration: changed %v, err %v, want nothing more", changed, err)
	}
	for _, p := range []*corev1.Pod{src, tgt} {
		got, err := kube.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		want := corev1.PodRunning
		if p == src {
			want = corev1.PodSucceeded
		}
		if got.Status.Phase != want {
			t.Errorf("virt-launcher pod %s on %s is %s, want %s", p.Name, p.Spec.NodeName, got.Status.Phase, want)
		}
	}
}
