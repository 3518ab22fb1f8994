// Package kubevirtsim simulates the parts of KubeVirt (and a little of
// Harvester and Longhorn) that volume hotplug depends on, on top of a real
// kube-apiserver. It implements the simulator contract of the shared
// reference (kubevirt-hotplug.md §7).
//
// What runs:
//
//   - Install: CRDs for VirtualMachine, VirtualMachineInstance and KubeVirt
//     (kubevirt.io/v1, status subresource, schemas that preserve unknown
//     fields so kubevirt.io/api objects round-trip) and Harvester's Setting
//     (harvesterhci.io/v1beta1, cluster-scoped); stand-ins for
//     external-snapshotter's VolumeSnapshot, VolumeSnapshotContent and
//     VolumeSnapshotClass CRDs (snapshot.storage.k8s.io/v1); the KubeVirt CR
//     with the feature gates of the mode; the server-version setting; the host
//     StorageClass; the VolumeSnapshotClass SnapshotClass and Harvester's
//     csi-driver-config setting that names it.
//   - A front proxy (plain HTTP on 127.0.0.1) serving PUT
//     /apis/subresources.kubevirt.io/v1/namespaces/{ns}/{virtualmachines|virtualmachineinstances}/{name}/{addvolume|removevolume}
//     with virt-api's checks, order, codes and messages (§1.1), after asking
//     the API server whether the caller may "update" that subresource. Every
//     other request is reverse-proxied (watches stream) with the caller's
//     Authorization header. Stats counts what reached the proxy.
//   - Real validating admission webhooks (TLS on 127.0.0.1, registered as a
//     ValidatingWebhookConfiguration): the VM status validator
//     (WebhookVMStatus: duplicate requests, name conflicts, bus rules per
//     profile, migrations), the VM validator's snapshot rule (WebhookVM) and
//     a Harvester-like volume denial switch (WebhookHarvester, DenyVolume).
//     Denials come back from the API server as 422
//     `admission webhook "<name>" denied the request: <message>`.
//   - The VM controller: start/stop, the legacy volumeRequests processing
//     (§2: per VM, in order, VMI path first, spec Update with the cached
//     resourceVersion, trim, UpdateStatus, Failure conditions, per-VM
//     exponential backoff) and the declarative controller (§4).
//   - The VMI controller and virt-handler: lifecycle phases, one attachment
//     pod (hp-volume-xxxxx) per VMI holding every ready hotplug volume, the
//     volumeStatus machine of §3 with per-profile removal phases, the
//     attachment-pod livelock of kubevirt issue 16937, and DiskHook calls.
//   - A fake kubelet that starts (PodStart) and finishes deleting (PodDelete)
//     attachment pods, and a host provisioner that binds PVCs of the storage
//     class and plays the PVC/PV protection controllers. A PVC whose data
//     source is a VolumeSnapshot stays Pending until the snapshot is
//     readyToUse and no larger than the request, and is restored
//     (SnapshotHook.Restore) before it binds.
//   - The snapshot controller and Longhorn's snapshotter in one: a
//     VolumeSnapshot of a bound PVC gets, after Timings.Snapshot, a
//     VolumeSnapshotContent (snapcontent-<uid>), a SnapshotHook.Snapshot call
//     and readyToUse with restoreSize; one that cannot be taken gets
//     status.error and is retried. Deleting it calls
//     SnapshotHook.DeleteSnapshot and deletes the content.
//
// No scheduler, kubelet or kube-controller-manager is needed. The
// simulator's own controllers talk to the API server directly, so Stats
// counts only client traffic.
//
// Typical use in a test:
//
//	sim, err := kubevirtsim.New(env.Config, kubevirtsim.Options{
//		Mode: kubevirtsim.ModeDeclarative, Namespace: "guests", Scale: 0.05,
//	})
//	if err := sim.Start(ctx); err != nil { ... }
//	defer sim.Stop()
//	sim.CreatePVC(ctx, "guests", "pvc-1", "1Gi", false)
//	sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: "guests", Name: "vm-1"})
//	cfg := sim.ClientConfig() // what the driver uses
//	...
//	sim.WaitVolumeReady(ctx, "guests", "vm-1", "pvc-1")
//
// Time: every latency is a field of Timings with the defaults of §7 item 21,
// multiplied by Options.Scale; Options.Jitter spreads them. virt-handler's
// one-second poll is modelled by deadlines (each step fires when its time has
// come); Timings.HandlerPoll paces retries of failed disk hooks.
//
// Faults: SetVMINotRunning, SetAttachmentPodsStuck, SetSnapshotInProgress,
// SetMigrationInProgress, DenyVolume/AllowVolume, SetFeatureGates and
// Options.StuckDetachOnReadd (v1.5).
//
// Not simulated: pre-provisioned snapshots (spec.source.volumeSnapshotContentName),
// default snapshot classes, the snapshot source-protection finalizers, backups,
// DataVolumes (a DataVolume source is treated as a PVC of the
// same name), the VMI update admitter's hotplug checks, live migration
// itself, virt-launcher pods, memory dumps, and the 1.9 profile.
package kubevirtsim
