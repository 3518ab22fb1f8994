package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testmetrics"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestNodeMonitor runs two controller replicas with the guest node monitor
// against a host (declarative KubeVirt 1.7) and a guest API server. Only the
// elected replica acts: a guest Node that goes NotReady after its VM stopped
// is tainted out of service, its volumes leave the VM through that replica's
// hotplug queue, and once the VM runs and the Node is Ready again the taint
// goes. After the leader stops, the other replica takes over, and a VM that
// stops after its Node went NotReady is noticed too.
func TestNodeMonitor(t *testing.T) {
	f := flavor{"declarative-v1.7", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, kvbackend.BackendDeclarative, false}
	h := framework.StartHost(t, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true})
	s := &suite{t: t, f: f, host: h, kv: kubevirt.NewForConfigOrDie(h.Env.Config)}
	g := framework.StartGuest(t)
	vm1, vm2 := "nm-vm-1", "nm-vm-2"
	node1, node2 := "rke2-nm-1", "rke2-nm-2"
	vols := s.scene(t, "nm", 3, vm1, vm2)
	g.AddPVs(t, vols...)
	g.AddNode(t, node1, vm1)
	g.AddNode(t, node2, vm2)

	replicas := map[string]*framework.Controller{}
	for _, id := range []string{"replica-a", "replica-b"} {
		replicas[id] = h.StartController(t, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfig(),
			Guest: g.Env.Config, DetachGuardTimeout: time.Hour, NodeMonitor: true,
			Monitor: guest.MonitorConfig{Identity: id, LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond}})
	}
	s.ctrl = replicas["replica-a"]
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	leader := waitLeader(ctx, t, g, replicas)
	a := newAttacher(s.client)
	for i, vm := range []string{vm1, vm1, vm2} {
		if err := a.publish(ctx, vm, vols[i]); err != nil {
			t.Fatal(err)
		}
	}

	// vm1 powers off; the guest's node lifecycle controller then marks its
	// Node Unknown (kubelet silent).
	if err := h.Sim.StopVM(ctx, h.Namespace, vm1); err != nil {
		t.Fatal(err)
	}
	if err := h.Sim.Wait(ctx, h.Namespace, vm1, func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi == nil }); err != nil {
		t.Fatal(err)
	}
	g.SetReady(t, node1, corev1.ConditionUnknown)
	waitNode(ctx, t, g, node1, "tainted out of service", hasOutOfServiceTaint)
	n, err := g.Kube.CoreV1().Nodes().Get(ctx, node1, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeOutOfService }); n.Spec.Taints[i].Value != "nodeshutdown" {
		t.Errorf("taint %+v, want node.kubernetes.io/out-of-service=nodeshutdown:NoExecute", n.Spec.Taints[i])
	}
	testwait.Until(ctx, t, "the fenced node's volumes to leave its VM", func() (bool, string) {
		a, b := s.attachedTo(vols[0], vm1), s.attachedTo(vols[1], vm1)
		return len(a)+len(b) == 0, fmt.Sprint(a, b)
	})
	// Through the queue of the replica that leads, never around it. The API
	// server shows the volumes gone a moment before the leader's informers
	// let its queue finish the detaches: wait for the queue.
	testwait.Until(ctx, t, "the leader's queue to complete the fenced node's 2 detaches", func() (bool, string) {
		got := detachesDone(t, replicas[leader])
		return got >= 2, fmt.Sprintf("%d completed", got)
	})
	for id, r := range replicas {
		if got := detachesDone(t, r); id != leader && got != 0 {
			t.Errorf("replica %s, not leading, detached %d volumes", id, got)
		}
	}
	s.requireReady(vm2, vols[2])
	if n, err := g.Kube.CoreV1().Nodes().Get(ctx, node2, metav1.GetOptions{}); err != nil || hasOutOfServiceTaint(n) {
		t.Errorf("the healthy node was touched: %v %+v", err, n.Spec.Taints)
	}
	waitEvents(ctx, t, g, node1, "NodeOutOfService", "VolumesRemovedFromVM")

	// Back: the VM runs and the Node is Ready again.
	if err := h.Sim.StartVM(ctx, h.Namespace, vm1); err != nil {
		t.Fatal(err)
	}
	g.SetReady(t, node1, corev1.ConditionTrue)
	waitNode(ctx, t, g, node1, "out-of-service taint removed", func(n *corev1.Node) bool { return !hasOutOfServiceTaint(n) })
	waitEvents(ctx, t, g, node1, "NodeBackInService")

	// The leader goes away; the other replica takes the lease and acts. Its
	// Node goes NotReady first and the VM stops afterwards: only the VM's
	// change can trigger the decision.
	replicas[leader].Stop()
	delete(replicas, leader)
	next := waitLeader(ctx, t, g, replicas)
	g.SetReady(t, node2, corev1.ConditionFalse)
	if err := h.Sim.StopVM(ctx, h.Namespace, vm2); err != nil {
		t.Fatal(err)
	}
	waitNode(ctx, t, g, node2, "tainted out of service by "+next, hasOutOfServiceTaint)
	gone, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	testwait.Until(gone, t, vols[2]+" to leave "+vm2, func() (bool, string) {
		on := s.attachedTo(vols[2], vm2)
		return len(on) == 0, fmt.Sprintf("on %v", on)
	})
}

func hasOutOfServiceTaint(n *corev1.Node) bool { return guest.OutOfService(n) }

// waitLeader waits until exactly one replica leads and the Lease names it.
func waitLeader(ctx context.Context, t *testing.T, g *framework.Guest, replicas map[string]*framework.Controller) string {
	t.Helper()
	var holder string
	testwait.Until(ctx, t, "a single leader", func() (bool, string) {
		var leading []string
		for id, r := range replicas {
			if r.Driver.Monitor().Leading() {
				leading = append(leading, id)
			}
		}
		lease, err := g.Kube.CoordinationV1().Leases(guest.DefaultLeaseNamespace).Get(ctx, guest.DefaultLeaseName, metav1.GetOptions{})
		holder = ""
		if err == nil && lease.Spec.HolderIdentity != nil {
			holder = *lease.Spec.HolderIdentity
		}
		return len(leading) == 1 && holder == leading[0], fmt.Sprintf("leading %v, lease holder %q (%v)", leading, holder, err)
	})
	return holder
}

func waitNode(ctx context.Context, t *testing.T, g *framework.Guest, name, what string, cond func(*corev1.Node) bool) {
	t.Helper()
	testwait.Until(ctx, t, "node "+name+" "+what, func() (bool, string) {
		n, err := g.Kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		return err == nil && cond(n), fmt.Sprintf("%+v %v", n, err)
	})
}

// waitEvents waits for Events of these reasons on the guest Node: the
// monitor writes them after the change they report.
func waitEvents(ctx context.Context, t *testing.T, g *framework.Guest, node string, reasons ...string) {
	t.Helper()
	testwait.Until(ctx, t, fmt.Sprintf("events %v on %s", reasons, node), func() (bool, string) {
		var got []string
		for _, e := range g.NodeEvents(t, node) {
			got = append(got, e.Reason)
		}
		return !slices.ContainsFunc(reasons, func(r string) bool { return !slices.Contains(got, r) }), fmt.Sprint(got)
	})
}

// detachesDone counts the detach intents a replica's queue completed, from
// its metrics.
func detachesDone(t *testing.T, c *framework.Controller) uint64 {
	t.Helper()
	n, _ := testmetrics.Histogram(t, c.Metrics, "harvester_csi_hotplug_intent_duration_seconds", map[string]string{"op": "detach"})
	return n
}

// TestNodeMonitorSparesALiveLauncher: a VM whose VMI is gone while a
// virt-launcher pod of it still runs on the host (KubeVirt keeps the VMI until
// its pods are gone, so this is a VMI whose finalizer was removed by hand) is
// not known to be stopped: its NotReady Node keeps its pods and its volumes.
// Once the pod has ended, the Node is fenced and its volumes leave the VM.
func TestNodeMonitorSparesALiveLauncher(t *testing.T) {
	f := flavor{"declarative-v1.7", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, kvbackend.BackendDeclarative, false}
	h := framework.StartHost(t, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true})
	s := &suite{t: t, f: f, host: h, kv: kubevirt.NewForConfigOrDie(h.Env.Config)}
	g := framework.StartGuest(t)
	vm, node := "nl-vm-1", "rke2-nl-1"
	vols := s.scene(t, "nl", 1, vm)
	g.AddPVs(t, vols...)
	g.AddNode(t, node, vm)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfig(),
		Guest: g.Env.Config, DetachGuardTimeout: time.Hour, NodeMonitor: true,
		Monitor: guest.MonitorConfig{Identity: "replica-a", LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond}})
	s.ctrl = ctrl
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	waitLeader(ctx, t, g, map[string]*framework.Controller{"replica-a": ctrl})
	if err := newAttacher(s.client).publish(ctx, vm, vols[0]); err != nil {
		t.Fatal(err)
	}

	vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pods := h.Kube.CoreV1().Pods(h.Namespace)
	pod, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "virt-launcher-" + vm + "-abcde", Labels: map[string]string{kubevirtv1.AppLabel: "virt-launcher", kubevirtv1.CreatedByLabel: string(vmi.UID)},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(vmi, kubevirtv1.VirtualMachineInstanceGroupVersionKind)}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "compute", Image: "virt-launcher"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Status.Phase = corev1.PodRunning
	if pod, err = pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	h.Sim.ResetStats()
	if err := h.Sim.StopVM(ctx, h.Namespace, vm); err != nil {
		t.Fatal(err)
	}
	if err := h.Sim.Wait(ctx, h.Namespace, vm, func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi == nil }); err != nil {
		t.Fatal(err)
	}
	g.SetReady(t, node, corev1.ConditionUnknown)
	// The monitor lists the launcher pods only for a NotReady Node whose VMI
	// it does not see running: once it has, it has decided. A monitor that
	// does not ask fences or unplugs instead.
	testwait.Until(ctx, t, "the monitor's read of the launcher pods (or a fence)", func() (bool, string) {
		st := h.Sim.Stats()
		n, err := g.Kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		fenced := err == nil && hasOutOfServiceTaint(n) || len(s.attachedTo(vols[0], vm)) == 0
		return fenced || st.Answers[kubevirtsim.RequestKey{Verb: "list", Resource: "pods"}][200] > 0, fmt.Sprint(st.Answers)
	})
	if n, err := g.Kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); err != nil || hasOutOfServiceTaint(n) {
		t.Fatalf("node with a running launcher pod was fenced: %v %+v", err, n.Spec.Taints)
	}
	if got := s.attachedTo(vols[0], vm); len(got) == 0 {
		t.Fatalf("%s left the VM while its launcher pod runs", vols[0])
	}

	// The launcher ends; the next look at the VM (any change of it) fences.
	pod.Status.Phase = corev1.PodSucceeded
	if _, err := pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	touch := []byte(`{"metadata":{"annotations":{"test/touched":"yes"}}}`)
	if _, err := s.kv.KubevirtV1().VirtualMachines(h.Namespace).Patch(ctx, vm, types.MergePatchType, touch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitNode(ctx, t, g, node, "tainted out of service", hasOutOfServiceTaint)
	testwait.Until(ctx, t, vols[0]+" off the fenced node's VM", func() (bool, string) {
		got := s.attachedTo(vols[0], vm)
		return len(got) == 0, fmt.Sprint(got)
	})
}
