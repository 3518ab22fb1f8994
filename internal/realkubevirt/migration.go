package realkubevirt

// Live migration on KubeVirt's real control plane. virt-controller's
// migration controller creates the target virt-launcher pod and its
// attachment pod and hands the migration off through the VMI's
// migrationState; the node agents play the source and target virt-handler's
// part of the handshake, one status write per step, as kubevirt v1.7.0 (and
// v1.6.0, the same logic) writes it:
//
//  1. target, after the hand-off (the kubevirt.io/migrationTargetNodeName
//     label names its node): mounts the hotplug volumes from
//     migrationState.targetAttachmentPodUID and advertises its migration
//     proxy, targetNodeAddress and targetDirectMigrationNodePorts
//     (pkg/virt-handler/migration-target.go:636-644, :280-299). The
//     controller moves PreparingTarget to TargetReady on that
//     (pkg/virt-controller/watch/migration/migration.go:783-787).
//  2. source, once the target's ports are there: starts the transfer and
//     reports the domain's migration metadata, startTimestamp and mode
//     (pkg/virt-handler/migration-source.go:455-457, :549, :189-206); the
//     controller moves TargetReady to Running (migration.go:788-791).
//  3. target: the incoming domain appears, targetNodeDomainDetected
//     (migration-target.go:225-231).
//  4. target, once the transfer ends: the domain runs there,
//     targetNodeDomainReadyTimestamp, and the end is acknowledged in the
//     same write: endTimestamp, the kubevirt.io/nodeName label and
//     status.nodeName on the target node, migrationTransport Unix
//     (migration-target.go:241-261, :193-214).
//  5. target: finalizeMigration sets completed (migration-target.go:681-684,
//     :957-984); the controller then moves Running to Succeeded
//     (migration.go:816-822).
//  6. target: finalCleanup drops the kubevirt.io/migrationTargetNodeName
//     label (migration-target.go:453-456, :442-445).
//
// The source's domain is shut off as migrated when the transfer ends; its
// virt-handler then deletes it and virt-launcher exits
// (pkg/virt-handler/vm.go:377-381), so the source virt-launcher pod ends
// and virt-controller deletes the attachment pods it owned
// (pkg/virt-controller/watch/vmi/lifecycle.go:82,
// volume-hotplug.go:311-339). While the transfer runs, virt-handler's VM
// controller leaves the VMI alone (vm.go:391-394, controller.go:308-315):
// no hotplug pass.

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// migrationTransfer is how long a small guest's memory takes to copy, before
// Options.Scale: the simulated control plane's figure
// (internal/kubevirtsim migration.go), so a scenario's pace is the same on
// both.
const migrationTransfer = 5 * time.Second

// Migration proxy ports the target advertises: libvirt's own connection
// (0) and the direct migration port, 49152
// (pkg/virt-handler/migration-proxy/migration-proxy.go:42, :221-245). The
// listener ports are arbitrary: nothing connects to them here.
var targetMigrationPorts = map[string]int{"40001": 0, "40002": 49152}

// LauncherExit ends a virt-launcher pod's containers as virt-launcher exits
// once its domain has migrated away: with real kubelets only the host can
// end a container's process.
type LauncherExit interface {
	End(ctx context.Context, pod *corev1.Pod) error
}

// transfer is what a domain's migration metadata carries about one
// migration, kept on the node side as libvirt keeps it.
type transfer struct {
	start, end time.Time
	// sourceEnded: the source's virt-launcher was told to end.
	sourceEnded bool
}

// HoldMigration keeps the VM's transfer running until released: a guest
// dirtying memory faster than the link copies it.
func (c *ControlPlane) HoldMigration(namespace, vm string, on bool) {
	c.hold(namespace, vm, on)
}

func (a *nodeAgents) hold(namespace, name string, on bool) {
	a.mu.Lock()
	a.held[namespace+"/"+name] = on
	a.mu.Unlock()
	a.requeueVMI(namespace, name)
}

func (a *nodeAgents) transferOf(uid types.UID) *transfer {
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.transfers[uid]
	if t == nil {
		t = &transfer{}
		a.transfers[uid] = t
	}
	return t
}

// transferring reports whether virt-handler's VM controller leaves the VMI
// alone: a transfer started and not ended (controller.go:308-315).
func transferring(vmi *kubevirtv1.VirtualMachineInstance) bool {
	ms := vmi.Status.MigrationState
	return ms != nil && ms.StartTimestamp != nil && ms.EndTimestamp == nil
}

// syncMigration plays the next step of the VMI's migration, on vmi: it
// returns whether it changed the VMI (to be written) and when to look again.
func (a *nodeAgents) syncMigration(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) (bool, time.Duration, error) {
	ms := vmi.Status.MigrationState
	if ms == nil || ms.MigrationUID == "" || ms.TargetNode == "" || vmi.Status.Phase != kubevirtv1.Running {
		return false, 0, nil
	}
	t := a.transferOf(ms.MigrationUID)
	log := klog.FromContext(ctx).WithValues("vmi", klog.KObj(vmi), "migration", ms.MigrationUID, "source", ms.SourceNode, "target", ms.TargetNode)
	targetLabel := vmi.Labels[kubevirtv1.MigrationTargetNodeNameLabel]
	switch {
	case ms.EndTimestamp != nil && (ms.Completed || ms.Failed):
		if err := a.endSource(ctx, vmi, t); err != nil {
			return false, 0, err
		}
		if targetLabel == "" {
			return false, 0, nil
		}
		delete(vmi.Labels, kubevirtv1.MigrationTargetNodeNameLabel)
		log.V(2).Info("migration target cleaned up")
		return true, 0, nil
	case targetLabel != ms.TargetNode:
		return false, 0, nil // not handed off yet
	case ms.StartTimestamp == nil && ms.TargetDirectMigrationNodePorts == nil:
		if err := a.prepareTarget(vmi); err != nil {
			return false, 0, err
		}
		ms.TargetNodeAddress = a.nodeAddress(vmi.Namespace, ms.TargetPod)
		ms.TargetDirectMigrationNodePorts = targetMigrationPorts
		log.V(2).Info("migration target prepared", "address", ms.TargetNodeAddress)
		return true, 0, nil
	case ms.StartTimestamp == nil:
		now := time.Now()
		a.mu.Lock()
		t.start = now
		a.mu.Unlock()
		ms.StartTimestamp = ptrTime(now)
		ms.Mode = kubevirtv1.MigrationPreCopy
		log.V(2).Info("migration transfer started")
		return true, 0, nil
	case !ms.TargetNodeDomainDetected:
		ms.TargetNodeDomainDetected = true
		return true, 0, nil
	case ms.EndTimestamp == nil:
		if wait := a.transferLeft(vmi, t); wait != 0 {
			return false, max(wait, 0), nil
		}
		now := ptrTime(time.Now())
		ms.TargetNodeDomainReadyTimestamp = now
		ms.EndTimestamp = now
		vmi.Labels[kubevirtv1.NodeNameLabel] = ms.TargetNode
		delete(vmi.Labels, kubevirtv1.OutdatedLauncherImageLabel)
		vmi.Status.NodeName = ms.TargetNode
		vmi.Status.EvacuationNodeName = ""
		vmi.Status.LauncherContainerImageVersion = ""
		vmi.Status.MigrationTransport = kubevirtv1.MigrationTransportUnix
		log.V(2).Info("migration acknowledged by the target")
		return true, 0, nil
	case !ms.Completed && !ms.Failed:
		ms.Completed = true
		return true, 0, nil
	}
	return false, 0, nil
}

// transferLeft is how long the transfer still runs: 0 once it has ended, -1
// while it is held (the release requeues).
func (a *nodeAgents) transferLeft(vmi *kubevirtv1.VirtualMachineInstance, t *transfer) time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !t.end.IsZero() {
		return 0
	}
	if t.start.IsZero() {
		// The agents restarted mid-transfer: it starts again from the VMI.
		t.start = vmi.Status.MigrationState.StartTimestamp.Time
	}
	if a.held[vmi.Namespace+"/"+vmi.Name] {
		return -1
	}
	if left := time.Until(t.start.Add(a.transferTime)); left > 0 {
		return left
	}
	t.end = time.Now()
	return 0
}

// prepareTarget is the target's syncVolumes: the hotplug volumes are mounted
// from the target attachment pod the hand-off named, which must hold every
// one of them (migration-target.go:636-644).
func (a *nodeAgents) prepareTarget(vmi *kubevirtv1.VirtualMachineInstance) error {
	uid := vmi.Status.MigrationState.TargetAttachmentPodUID
	if uid == "" {
		return nil
	}
	pods, err := a.namespacePods(vmi.Namespace)
	if err != nil {
		return err
	}
	for _, p := range pods {
		if p.UID != uid {
			continue
		}
		if p.Spec.NodeName != vmi.Status.MigrationState.TargetNode {
			return fmt.Errorf("failed to mount hotplug volumes: attachment pod %s is on %q, not the target node %s", p.Name, p.Spec.NodeName, vmi.Status.MigrationState.TargetNode)
		}
		return nil
	}
	return fmt.Errorf("failed to mount hotplug volumes: target attachment pod %s not found", uid)
}

// nodeAddress is the target virt-handler's migration address: its node's,
// which the target virt-launcher pod reports as its host IP.
func (a *nodeAgents) nodeAddress(namespace, pod string) string {
	if obj, ok, err := a.pods.GetByKey(namespace + "/" + pod); err == nil && ok {
		if ip := obj.(*corev1.Pod).Status.HostIP; ip != "" {
			return ip
		}
	}
	return "127.0.0.1"
}

// endSource ends the source's virt-launcher pods once the VMI has moved off
// the source node: the source virt-handler deletes the migrated domain and
// virt-launcher exits (vm.go:377-381).
func (a *nodeAgents) endSource(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, t *transfer) error {
	ms := vmi.Status.MigrationState
	a.mu.Lock()
	done := t.sourceEnded
	a.mu.Unlock()
	if done || ms.Failed || ms.SourceNode == "" || vmi.Status.NodeName == ms.SourceNode {
		return nil
	}
	pods, err := a.namespacePods(vmi.Namespace)
	if err != nil {
		return err
	}
	for _, p := range pods {
		if !isLauncherOn(p, vmi, ms.SourceNode) || podFinished(p) {
			continue
		}
		if err := a.endLauncher(ctx, p); err != nil {
			return fmt.Errorf("source virt-launcher pod %s: %w", p.Name, err)
		}
		klog.FromContext(ctx).V(2).Info("source virt-launcher ended after the migration", "vmi", klog.KObj(vmi), "pod", klog.KObj(p), "node", ms.SourceNode)
	}
	a.mu.Lock()
	t.sourceEnded = true
	a.mu.Unlock()
	return nil
}

// endLauncher ends a virt-launcher pod's containers, exit code 0: through
// the host with real kubelets, else as the kubelet stand-in reports it.
func (a *nodeAgents) endLauncher(ctx context.Context, p *corev1.Pod) error {
	if a.kubelets {
		if a.launchers == nil {
			return fmt.Errorf("no way to end its containers on %s", p.Spec.NodeName)
		}
		return a.launchers.End(ctx, p)
	}
	done := p.DeepCopy()
	done.Status.Phase = corev1.PodSucceeded
	now := metav1.Now()
	for i := range done.Status.ContainerStatuses {
		cs := &done.Status.ContainerStatuses[i]
		cs.Ready, cs.Started = false, nil
		cs.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{Reason: "Completed", FinishedAt: now}}
	}
	_, err := a.kube.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, done, metav1.UpdateOptions{})
	return err
}

func podFinished(p *corev1.Pod) bool {
	return p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
}

func ptrTime(t time.Time) *metav1.Time {
	mt := metav1.NewTime(t)
	return &mt
}
