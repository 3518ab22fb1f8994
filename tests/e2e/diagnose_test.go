package e2e

import (
	"context"
	"fmt"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
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
// disagreement diagnose is there to find (a ghost attachment, a
// VolumeAttachment whose volume KubeVirt lost, a volume in two VMs, legacy
// requests stuck behind a refused update, a VolumeAttachment with a detach
// error) next to a healthy volume, and checks that diagnose names each one,
// with its volume and VM, and nothing about the healthy volume.
func TestDiagnoseNamesFabricatedDisagreements(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_6_3, Scale: 0.05, BindClasslessPVCs: true})
	h.CreateVMs(t, "dg-a", "dg-b")
	// dg-00 healthy, 01 ghost, 02 lost, 03 two VMs, 04 refused, 05 detach
	// error, 06 stuck in its attachment pod (not Ready, and a slow intent).
	vols := h.CreateVolumes(t, "dg", 7)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 50 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	guestEnv, err := testenv.Start(ctx, testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(guestEnv.Stop)
	guest := kubernetes.NewForConfigOrDie(guestEnv.Config)
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
	publish(vols[1]) // ghost: nobody in the guest wants it
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
		diagnose.GhostAttachment + "/" + vols[1] + "/dg-a",
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
