package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestDiagnoseNamesFabricatedDisagreements builds, on real API servers, each
// disagreement diagnose is there to find (a volume in a VM that no guest
// VolumeAttachment asks for, a
// VolumeAttachment whose volume KubeVirt lost, a volume in two VMs, legacy
// requests stuck behind a refused update, a VolumeAttachment with a detach
// error) next to a healthy volume, and checks that diagnose names each one,
// with its volume and VM, and nothing about the healthy volume.
func TestDiagnoseNamesFabricatedDisagreements(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_6_3, Scale: 0.05, BindClasslessPVCs: true})
	h.CreateVMs(t, "dg-a", "dg-b")
	// dg-00 healthy, 01 orphaned, 02 lost, 03 two VMs, 04 refused, 05 detach
	// error, 06 stuck in its attachment pod (not Ready, and a slow intent).
	vols := h.CreateVolumes(t, "dg", 7)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	guest := framework.StartGuest(t).Kube
	mustCreate(t, func() error {
		_, err := guest.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"},
			Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: "dg-a"}}}}, metav1.CreateOptions{})
		return err
	})
	publish := func(vol string) {
		t.Helper()
		_, err := ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "dg-a",
			VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}})
		if err != nil {
			t.Fatalf("publish %s: %v", vol, err)
		}
	}
	attachVA := func(vol string, attached bool, detachErr string) {
		t.Helper()
		mustCreate(t, func() error {
			_, err := guest.CoreV1().PersistentVolumes().Create(ctx, guestPV(vol), metav1.CreateOptions{})
			return err
		})
		va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "csi-" + vol},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: "node-a", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &vol}}}
		va, err := guest.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		va.Status.Attached = attached
		if detachErr != "" {
			va.Status.DetachError = &storagev1.VolumeError{Time: metav1.Now(), Message: detachErr}
		}
		if _, err := guest.StorageV1().VolumeAttachments().UpdateStatus(ctx, va, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	viaAPI := kubevirt.NewForConfigOrDie(h.Sim.ClientConfig())
	admin := kubevirt.NewForConfigOrDie(h.Env.Config)

	publish(vols[0])
	attachVA(vols[0], true, "")
	// Orphaned: nobody in the guest asks for it; its guest PV makes it
	// this guest's.
	publish(vols[1])
	mustCreate(t, func() error {
		_, err := guest.CoreV1().PersistentVolumes().Create(ctx, guestPV(vols[1]), metav1.CreateOptions{})
		return err
	})
	publish(vols[2])
	attachVA(vols[2], true, "")
	if err := viaAPI.KubevirtV1().VirtualMachines(h.Namespace).RemoveVolume(ctx, "dg-a", &kubevirtv1.RemoveVolumeOptions{Name: vols[2]}); err != nil {
		t.Fatal(err)
	}
	if err := h.Sim.WaitVolumeDetached(ctx, h.Namespace, "dg-a", vols[2]); err != nil {
		t.Fatal(err)
	}
	publish(vols[3])
	attachVA(vols[3], true, "")
	// Another client puts the same volume into dg-b's spec.
	vmB, err := admin.KubevirtV1().VirtualMachines(h.Namespace).Get(ctx, "dg-b", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vmB.Spec.Template.Spec.Volumes = append(vmB.Spec.Template.Spec.Volumes, kubevirtv1.Volume{Name: vols[3], VolumeSource: kubevirtv1.VolumeSource{
		PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: vols[3]}, Hotpluggable: true}}})
	if _, err := admin.KubevirtV1().VirtualMachines(h.Namespace).Update(ctx, vmB, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// A webhook refuses virt-controller's update for an add queued by hand.
	h.Sim.Faults().DenyVolume(vols[4], "volume "+vols[4]+" is refused by policy")
	err = viaAPI.KubevirtV1().VirtualMachines(h.Namespace).AddVolume(ctx, "dg-b", &kubevirtv1.AddVolumeOptions{Name: vols[4],
		Disk: &kubevirtv1.Disk{Name: vols[4], DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: vols[4]}, Hotpluggable: true}}})
	if err != nil {
		t.Fatal(err)
	}
	attachVA(vols[5], false, "rpc error: code = Unavailable desc = host unreachable")
	// An attachment pod that never starts: the publish gives up, the intent
	// stays and waits.
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, "dg-b", true)
	defer h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, "dg-b", false)
	cctx, c := context.WithTimeout(ctx, 3*time.Second)
	_, err = ctrl.Client.ControllerPublishVolume(cctx, &csi.ControllerPublishVolumeRequest{VolumeId: vols[6], NodeId: "dg-b",
		VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}})
	c()
	if err == nil {
		t.Fatal("a publish whose attachment pod never starts answered OK")
	}

	state := httptest.NewServer(diagnose.StateHandler(ctrl.Queue.State))
	defer state.Close()
	hc, err := host.NewForConfig(h.Env.Config, h.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		diagnose.InVMWithoutAttachment + "/" + vols[1] + "/dg-a",
		diagnose.LostAttachment + "/" + vols[2] + "/dg-a",
		diagnose.TwoHolders + "/" + vols[3] + "/",
		diagnose.StuckRequests + "//dg-b",
		diagnose.StuckVolumeAttachment + "/" + vols[5] + "/dg-a",
		diagnose.NotReady + "/" + vols[6] + "/dg-b",
		diagnose.SlowIntent + "/" + vols[6] + "/dg-b",
	}
	var got []string
	testwait.Until(ctx, t, "diagnose to name every fabricated disagreement", func() (bool, string) {
		in, err := diagnose.Gather(ctx, diagnose.Sources{Host: hc, Guest: guest, Controller: state.URL, Driver: driver.Name})
		if err != nil {
			return false, err.Error()
		}
		in.SlowAfter = time.Second
		got = nil
		for _, f := range diagnose.Check(in) {
			got = append(got, f.Kind+"/"+f.Volume+"/"+f.VM)
		}
		for _, w := range want {
			if !slices.Contains(got, w) {
				return false, fmt.Sprintf("missing %s in %v", w, got)
			}
		}
		return true, ""
	})
	for _, g := range got {
		if g == diagnose.GhostAttachment+"/"+vols[0]+"/dg-a" || g == diagnose.LostAttachment+"/"+vols[0]+"/dg-a" {
			t.Errorf("the healthy volume is reported: %s", g)
		}
	}
}

// TestDiagnoseOrphansExportsAndReregisteringNodes fabricates on real API
// servers what diagnose used to get wrong, in three steps on one guest:
//
//  1. a volume in a VM of this guest while the guest has no VolumeAttachment
//     at all: an orphaned hot-plug, exit 1;
//  2. a healthy guest: that volume now attached, a ReadWriteMany volume
//     attached on two Nodes with its export serving, and a volume attached
//     on a Node whose CSINode lacks the driver (its node plugin registers
//     again) but whose providerID names its VM: no finding, exit 0;
//  3. a ReadWriteMany volume attached while its export is disabled, and an
//     attachment on an unregistered Node that maps to no VM: the export is a
//     finding, the Node an informational one.
func TestDiagnoseOrphansExportsAndReregisteringNodes(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	h.CreateVMs(t, "dr-a", "dr-c")
	vols := h.CreateVolumes(t, "dr", 3)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	if !ctrl.Driver.RWXEnabled() {
		t.Fatal("the simulator lists NetworkFilesystems, but the controller does not serve RWX volumes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	hc, err := host.NewForConfig(h.Env.Config, h.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	look := func(step string, want []string, wantCode int) {
		t.Helper()
		in, err := diagnose.Gather(ctx, diagnose.Sources{Host: hc, Guest: g.Kube, Driver: driver.Name})
		if err != nil {
			t.Fatal(err)
		}
		in.SlowAfter = time.Minute
		findings := diagnose.Check(in)
		var got []string
		for _, f := range findings {
			got = append(got, f.Kind+"/"+f.Volume+"/"+f.VM+"/"+f.Node)
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("%s: findings %v, want %v", step, findings, want)
		}
		var out strings.Builder
		if code := diagnose.Report(&out, in, findings); code != wantCode {
			t.Errorf("%s: exit code %d, want %d:\n%s", step, code, wantCode, out.String())
		}
	}
	node := func(name, providerID, nodeID string) {
		t.Helper()
		mustCreate(t, func() error {
			_, err := g.Kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{ProviderID: providerID}}, metav1.CreateOptions{})
			return err
		})
		cn := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if nodeID != "" {
			cn.Spec.Drivers = []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: nodeID}}
		}
		mustCreate(t, func() error {
			_, err := g.Kube.StorageV1().CSINodes().Create(ctx, cn, metav1.CreateOptions{})
			return err
		})
	}
	attached := func(vol, nodeName string, rwx bool) {
		t.Helper()
		pv := guestPV(vol)
		if rwx {
			pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
		}
		mustCreate(t, func() error {
			_, err := g.Kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
			return err
		})
		va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "csi-" + vol + "-" + nodeName},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: nodeName, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &vol}}}
		va, err := g.Kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		va.Status.Attached = true
		if _, err := g.Kube.StorageV1().VolumeAttachments().UpdateStatus(ctx, va, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	rwoCap := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	rwxCap := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER}}
	publish := func(vol, vm string, c *csi.VolumeCapability) {
		t.Helper()
		if _, err := ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: c}); err != nil {
			t.Fatalf("publish %s to %s: %v", vol, vm, err)
		}
	}
	createRWX := func(name string) string {
		t.Helper()
		resp, err := ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwxCap},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}, Parameters: map[string]string{"hostStorageClass": kubevirtsim.DefaultStorageClass}})
		if err != nil {
			t.Fatalf("create RWX volume %s: %v", name, err)
		}
		return resp.GetVolume().GetVolumeId()
	}

	node("node-a", "", "dr-a")
	publish(vols[0], "dr-a", rwoCap)
	mustCreate(t, func() error { // the guest PV that makes it this guest's
		_, err := g.Kube.CoreV1().PersistentVolumes().Create(ctx, guestPV(vols[0]), metav1.CreateOptions{})
		return err
	})
	look("a volume in this guest's VM and no VolumeAttachment at all",
		[]string{diagnose.InVMWithoutAttachment + "/" + vols[0] + "/dr-a/"}, diagnose.ExitFindings)

	attached(vols[0], "node-a", false)
	vmC, err := kubevirt.NewForConfigOrDie(h.Env.Config).KubevirtV1().VirtualMachines(h.Namespace).Get(ctx, "dr-c", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node("node-c", "harvester://"+string(vmC.UID), "")
	publish(vols[1], "dr-c", rwoCap)
	attached(vols[1], "node-c", false)
	shared := createRWX("pvc-dr-shared")
	publish(shared, "dr-a", rwxCap)
	publish(shared, "dr-c", rwxCap)
	attached(shared, "node-a", true)
	attached(shared, "node-c", true)
	look("healthy: attached, RWX exported, a Node whose plugin registers again", nil, diagnose.ExitClean)

	unexported := createRWX("pvc-dr-unexported")
	attached(unexported, "node-a", true)
	node("node-x", "", "")
	attached(vols[2], "node-x", false)
	look("an RWX volume without its export, a Node that maps to no VM", []string{
		diagnose.NodePluginNotRegistered + "///node-x",
		diagnose.RWXExportNotEnabled + "/" + unexported + "/dr-a/node-a",
	}, diagnose.ExitFindings)
}

// TestDiagnoseInThePodWithoutFlags runs the command as an operator does in
// the controller pod, with no flag: the host kubeconfig at the chart's path,
// the guest through the in-cluster config, the queue of the replica whose
// external-attacher holds the leader Lease (two replicas serve their state;
// only the leader's queue has the stuck publish), and -o json. It finds the
// host side fabricated next to it: a guest PV whose host PVC is missing, one
// whose host PVC stays Pending, a Pending attachment pod, a CSINode naming no
// VM. Without the Lease every replica is read and merged.
func TestDiagnoseInThePodWithoutFlags(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	h.CreateVMs(t, "dp-a")
	vols := h.CreateVolumes(t, "dp", 1)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	g.AddNode(t, "node-a", "dp-a")
	mustCreate(t, func() error {
		_, err := g.Kube.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: "node-z"},
			Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: "dp-gone"}}}}, metav1.CreateOptions{})
		return err
	})

	// The chart's host kubeconfig, in a directory of the test.
	dir := t.TempDir()
	env := diagnose.Env{HostKubeconfig: dir + "/cloud-provider-config", HostFallback: dir + "/no-cloud-config",
		InCluster: func() (*rest.Config, error) { return rest.CopyConfig(g.Env.Config), nil }, PodNamespace: func() string { return "kube-system" }}
	if err := testenv.WriteKubeconfig(env.HostKubeconfig, h.Env.Config, h.Namespace); err != nil {
		t.Fatal(err)
	}

	// Host side: a PVC no provisioner binds, and guest PVs of it and of a
	// claim that does not exist.
	admin := kubernetes.NewForConfigOrDie(h.Env.Config)
	mustCreate(t, func() error {
		_, err := admin.CoreV1().PersistentVolumeClaims(h.Namespace).Create(ctx, &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "dp-unbound"},
			Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: ptr.To("no-such-class"), AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}, metav1.CreateOptions{})
		return err
	})
	for _, name := range []string{"dp-unbound", "dp-no-claim"} {
		mustCreate(t, func() error {
			_, err := g.Kube.CoreV1().PersistentVolumes().Create(ctx, guestPV(name), metav1.CreateOptions{})
			return err
		})
	}
	// A publish whose attachment pod never starts: the leader's queue keeps
	// the intent, the host keeps the Pending pod.
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, "dp-a", true)
	defer h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, "dp-a", false)
	mustCreate(t, func() error {
		_, err := g.Kube.CoreV1().PersistentVolumes().Create(ctx, guestPV(vols[0]), metav1.CreateOptions{})
		return err
	})
	cctx, c := context.WithTimeout(ctx, 3*time.Second)
	_, err := ctrl.Client.ControllerPublishVolume(cctx, &csi.ControllerPublishVolumeRequest{VolumeId: vols[0], NodeId: "dp-a",
		VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}})
	c()
	if err == nil {
		t.Fatal("a publish whose attachment pod never starts answered OK")
	}

	// Two controller replicas in the guest, at 127.0.0.1 on their own ports:
	// the leader serves the controller's queue, the other an idle one.
	leader := httptest.NewServer(diagnose.StateHandler(ctrl.Queue.State))
	defer leader.Close()
	idle := httptest.NewServer(diagnose.StateHandler(func() []hotplug.VMState { return nil }))
	defer idle.Close()
	replica := func(name, url string) {
		t.Helper()
		port, err := strconv.Atoi(url[strings.LastIndex(url, ":")+1:])
		if err != nil {
			t.Fatal(err)
		}
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "kube-system",
			Labels: map[string]string{"component": "csi-controllers", "app.kubernetes.io/name": "harvester-csi-driver"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "harvester-csi-driver", Image: "driver",
				Ports: []corev1.ContainerPort{{Name: diagnose.MetricsPortName, ContainerPort: int32(port)}}}}}}
		p, err = g.Kube.CoreV1().Pods("kube-system").Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status.Phase, p.Status.PodIP = corev1.PodRunning, "127.0.0.1"
		if _, err := g.Kube.CoreV1().Pods("kube-system").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	replica("ctrl-idle", idle.URL)
	replica("ctrl-leader", leader.URL)
	mustCreate(t, func() error {
		_, err := g.Kube.CoordinationV1().Leases("kube-system").Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: diagnose.AttacherLeaseName(driver.Name)}, Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("ctrl-leader")}}, metav1.CreateOptions{})
		return err
	})

	want := []string{
		diagnose.AttachmentPodPending + "/" + vols[0] + "/dp-a/",
		diagnose.CSINodeUnknownVM + "//dp-gone/node-z",
		diagnose.HostClaimMissing + "/dp-no-claim//",
		diagnose.HostClaimPending + "/dp-unbound//",
		diagnose.SlowIntent + "/" + vols[0] + "/dp-a/",
	}
	run := func(step, wantSource string) {
		t.Helper()
		testwait.Until(ctx, t, step, func() (bool, string) {
			var out, errOut strings.Builder
			code := diagnose.Run(ctx, diagnose.Options{Driver: driver.Name, Output: diagnose.OutputJSON, SlowAfter: time.Second, Timeout: 30 * time.Second},
				env, &out, &errOut)
			var rep diagnose.JSONReport
			if err := json.Unmarshal([]byte(out.String()), &rep); err != nil {
				return false, fmt.Sprintf("exit %d, stderr %s, not JSON: %v", code, errOut.String(), err)
			}
			var got []string
			for _, f := range rep.Findings {
				got = append(got, f.Kind+"/"+f.Volume+"/"+f.VM+"/"+f.Node)
			}
			for _, w := range want {
				if !slices.Contains(got, w) {
					return false, fmt.Sprintf("missing %s in %v (notes %v)", w, got, rep.Notes)
				}
			}
			if code != diagnose.ExitFindings || rep.ExitCode != code || rep.QueueSource != wantSource {
				return false, fmt.Sprintf("exit %d (report %d), queue read from %q, want %q", code, rep.ExitCode, rep.QueueSource, wantSource)
			}
			return true, ""
		})
	}
	run("diagnose in the pod reads the attacher leader's queue and the host side", "replica ctrl-leader (holder of Lease kube-system/"+diagnose.AttacherLeaseName(driver.Name)+")")
	if err := g.Kube.CoordinationV1().Leases("kube-system").Delete(ctx, diagnose.AttacherLeaseName(driver.Name), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	run("diagnose without the Lease merges every replica", "replicas ctrl-idle, ctrl-leader merged")
}
