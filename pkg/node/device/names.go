package device

// The by-id names a hot-plugged disk gets, worked out from the code that
// produces them:
//
//   - KubeVirt gives every disk the libvirt alias "ua-<disk name>" (v1.7.0
//     pkg/virt-launcher/virtwrap/converter/converter.go:211, v1.6.3 :207,
//     api.UserAliasPrefix in pkg/virt-launcher/virtwrap/api/schema.go) and
//     passes the disk's serial through unchanged (converter.go:157), which is
//     empty unless the hotplug request set one. KubeVirt itself never sets one
//     for a hotplug; virtctl addvolume defaults it to the volume name
//     (v1.7.0 pkg/virtctl/vm/add_volume.go:164-166). This driver and upstream
//     plug with bus scsi and no serial (pkg/kubevirt).
//   - For a scsi-hd disk libvirt sets the SCSI device identification (VPD
//     page 0x83) to the serial, or to "drive-<alias>" when there is none
//     (libvirt src/qemu/qemu_command.c, qemuBuildDiskDeviceProps). QEMU
//     reports up to 255-8 bytes of it (hw/scsi/scsi-disk.c,
//     scsi_disk_emulate_vpd_page, page 0x83), far more than a
//     disk name can have: KubeVirt requires DNS-1123 labels, at most 63
//     characters (v1.7.0 pkg/storage/admitters/disks.go:293).
//   - udev's scsi_id makes that "0" + vendor + product + identifier with runs
//     of blanks replaced by "_", and 60-persistent-storage.rules links the disk
//     as "scsi-$ID_SERIAL" and its partitions as "scsi-$ID_SERIAL-partN".
//     For virtio-blk the rules use the serial attribute: "virtio-<serial>",
//     and no by-id link at all without a serial. virtio-blk carries at most
//     20 bytes of serial (VIRTIO_BLK_ID_BYTES in Linux's
//     include/uapi/linux/virtio_blk.h), so a longer serial arrives cut
//     and every volume with the same first 20 characters gets the same name.

// Prefix udev puts before the identifier of a QEMU SCSI hard disk.
const scsiPrefix = "scsi-0QEMU_QEMU_HARDDISK_"

// VirtioSerialBytes is how much of a serial a virtio-blk disk reports.
const VirtioSerialBytes = 20

// LinkNames returns every by-id name that identifies exactly the disk of
// volumeID: the scsi disk without serial (what this driver and upstream
// plug), and the scsi and virtio disks whose serial is the volume ID (what
// virtctl plugs by default), the virtio one only while the ID fits whole.
// A disk whose serial was set to another volume's "drive-ua-<ID>" would
// look like that volume's; only a hand-made hotplug can do that.
func LinkNames(volumeID string) []string {
	names := []string{scsiPrefix + "drive-ua-" + volumeID, scsiPrefix + volumeID}
	if len(volumeID) <= VirtioSerialBytes {
		names = append(names, "virtio-"+volumeID)
	}
	return names
}

// TruncatedVirtioName is the virtio by-id name a disk with serial volumeID
// gets when the ID is too long to fit; ok is false when it fits.
func TruncatedVirtioName(volumeID string) (name string, ok bool) {
	if len(volumeID) <= VirtioSerialBytes {
		return "", false
	}
	return "virtio-" + volumeID[:VirtioSerialBytes], true
}
