"""A faithful reduced copy of pytorch/examples' imagenet/main.py (BSD-3-Clause;
https://github.com/pytorch/examples, imagenet/main.py as of commit 77f55b9,
Aug 2025): its argument names, its main / main_worker / train / validate
structure, its epoch loop (``set_epoch``, train, validate with its metric
all-reduces, ``scheduler.step()``, ``save_checkpoint``), AverageMeter,
ProgressMeter and accuracy as upstream has them. The upstream file is not
copied at test time: the tests run offline. Edits, each marked in the code:

* ``# reduced:`` torchvision does not import next to the CPU torch wheel
  (PyPI's torchvision is the CUDA build), so ``models.resnet18`` and
  ``datasets.FakeData`` (with ``ToTensor``) are written out below
  (torchvision's ResNet-18 layout and initialisation; FakeData's per-index
  seeded image and target); ``--arch`` accepts resnet18 only; no
  ``--multiprocessing-distributed`` (the launcher starts the ranks), no
  ``--pretrained`` / ``--resume`` / ``--evaluate`` / ``--gpu``; the fake data
  sets' sizes and image size are arguments (upstream: 1281167 and 50000
  images of 224x224);
* ``# CPU:`` upstream wraps the model in DDP only on an accelerator (on the
  CPU its ranks would train separate models): here DDP over gloo on the CPU,
  the accelerator branches dropped;
* ``# test:`` ``--lr-step`` (StepLR's step_size, upstream 30: 1 here, so every
  epoch has its own LR), ``--out`` (every rank's final state), ``--step-log``
  (``<attempt> <step>`` per optimizer step, from a step counter kept in the
  resumable state);
* ``# jitckpt:`` the four lines that make it exactly resumable under jitrun.

    torchrun --nproc-per-node 2 tests/imagenet_main.py --dummy --dist-url env:// --dist-backend gloo \
        --seed 0 -b 4 -j 0 --epochs 3 --image-size 64
"""

# ruff: noqa: UP031, UP032, B028 - upstream's own style, kept so the copy reads like the original

import argparse
import os
import random
import shutil
import time
import warnings
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.parallel
import torch.optim
import torch.utils.data
import torch.utils.data.distributed
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Subset

import jitckpt  # jitckpt:

parser = argparse.ArgumentParser(description='PyTorch ImageNet Training')
parser.add_argument('data', metavar='DIR', nargs='?', default='imagenet',
                    help='path to dataset (default: imagenet)')
parser.add_argument('-a', '--arch', metavar='ARCH', default='resnet18',
                    choices=['resnet18'],  # reduced: torchvision's models.__dict__
                    help='model architecture (default: resnet18)')
parser.add_argument('-j', '--workers', default=4, type=int, metavar='N',
                    help='number of data loading workers (default: 4)')
parser.add_argument('--epochs', default=90, type=int, metavar='N',
                    help='number of total epochs to run')
parser.add_argument('--start-epoch', default=0, type=int, metavar='N',
                    help='manual epoch number (useful on restarts)')
parser.add_argument('-b', '--batch-size', default=256, type=int, metavar='N',
                    help='mini-batch size (default: 256)')
parser.add_argument('--lr', '--learning-rate', default=0.1, type=float,
                    metavar='LR', help='initial learning rate', dest='lr')
parser.add_argument('--momentum', default=0.9, type=float, metavar='M',
                    help='momentum')
parser.add_argument('--wd', '--weight-decay', default=1e-4, type=float,
                    metavar='W', help='weight decay (default: 1e-4)',
                    dest='weight_decay')
parser.add_argument('-p', '--print-freq', default=10, type=int,
                    metavar='N', help='print frequency (default: 10)')
parser.add_argument('--world-size', default=-1, type=int,
                    help='number of nodes for distributed training')
parser.add_argument('--rank', default=-1, type=int,
                    help='node rank for distributed training')
parser.add_argument('--dist-url', default='tcp://224.66.41.62:23456', type=str,
                    help='url used to set up distributed training')
parser.add_argument('--dist-backend', default='nccl', type=str,
                    help='distributed backend')
parser.add_argument('--seed', default=None, type=int,
                    help='seed for initializing training. ')
parser.add_argument('--dummy', action='store_true', help="use fake data to benchmark")
parser.add_argument('--dummy-train-size', default=1281167, type=int)  # reduced:
parser.add_argument('--dummy-val-size', default=50000, type=int)  # reduced:
parser.add_argument('--image-size', default=224, type=int)  # reduced:
parser.add_argument('--lr-step', default=30, type=int)  # test:
parser.add_argument('--out', default=None)  # test: every rank writes its final state to OUT.rank<R>.pt
parser.add_argument('--step-log', default=None)  # test: '<attempt> <step>' lines, STEP_LOG.rank<R>

best_acc1 = 0


# -- reduced: torchvision.models.resnet18 ----------------------------------------------

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- reduced: torchvision.datasets.FakeData(size, image_size, num_classes, transforms.ToTensor()) --------

class FakeData(torch.utils.data.Dataset):
    def __init__(self, size, image_size, num_classes, random_offset=0):
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.random_offset = random_offset

    def __getitem__(self, index):
        # FakeData: the image and target of an index come from a generator seeded by it
        rng_state = torch.get_rng_state()
        torch.manual_seed(index + self.random_offset)
        img = torch.randn(*self.image_size)
        target = torch.randint(0, self.num_classes, size=(1,), dtype=torch.long)[0]
        torch.set_rng_state(rng_state)
        # ToPILImage then ToTensor: 8-bit pixels scaled to [0, 1]
        return img.clamp(0, 1).mul(255).to(torch.uint8).float().div(255), target

    def __len__(self):
        return self.size


def main():
    args = parser.parse_args()

    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        warnings.warn('You have chosen to seed training. '
                      'This will turn on the CUDNN deterministic setting, '
                      'which can slow down your training considerably! '
                      'You may see unexpected behavior when restarting '
                      'from checkpoints.')

    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])

    args.distributed = args.world_size > 1
    main_worker(args)  # reduced: no mp.spawn (--multiprocessing-distributed)


def create_model(args):
    """main_worker's model, criterion, optimizer and scheduler (reduced: split out)."""
    print("=> creating model '{}'".format(args.arch))
    model = ResNet()  # reduced: models.__dict__[args.arch]()
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)  # CPU: upstream does this on an accelerator only

    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss()

    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum,
                                weight_decay=args.weight_decay)

    """Sets the learning rate to the initial LR decayed by 10 every 30 epochs"""
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)  # test: step_size was 30
    return model, criterion, optimizer, scheduler


def create_loaders(args):
    """main_worker's data loading code (reduced: split out, --dummy only)."""
    print("=> Dummy data is used!")
    size = (3, args.image_size, args.image_size)
    train_dataset = FakeData(args.dummy_train_size, size, 1000)
    val_dataset = FakeData(args.dummy_val_size, size, 1000)

    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler = None
        val_sampler = None

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=False, sampler=train_sampler)  # CPU: pin_memory was True

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=False, sampler=val_sampler)  # CPU: pin_memory was True
    return train_sampler, train_loader, val_loader


def main_worker(args):
    global best_acc1

    if args.distributed:
        if args.dist_url == "env://" and args.rank == -1:
            args.rank = int(os.environ["RANK"])
        dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    model, criterion, optimizer, scheduler = create_model(args)
    train_sampler, train_loader, val_loader = create_loaders(args)
    # jitckpt: model, optimizer, scheduler, data position, RNG and counters, restored after a failure
    state = jitckpt.resumable(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=train_loader,
                              state={"epoch": args.start_epoch, "step": 0})  # test: "step"
    args.start_epoch = state["epoch"]  # jitckpt:

    for epoch in range(args.start_epoch, args.epochs):
        state["epoch"] = epoch  # jitckpt:
        if args.distributed:
            train_sampler.set_epoch(epoch)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, args, state)  # test: state

        # evaluate on validation set
        acc1 = validate(val_loader, model, criterion, args)

        scheduler.step()

        # remember best acc@1 and save checkpoint
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)

        save_checkpoint({
            'epoch': epoch + 1,
            'arch': args.arch,
            'state_dict': model.state_dict(),
            'best_acc1': best_acc1,
            'optimizer': optimizer.state_dict(),
            'scheduler': scheduler.state_dict()
        }, is_best)

    if args.out:  # test: every rank's final state, compared bit for bit
        module = model.module if args.distributed else model
        final = {"model": module.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()}
        torch.save(final, f"{args.out}.rank{max(args.rank, 0)}.pt.tmp")
        os.replace(f"{args.out}.rank{max(args.rank, 0)}.pt.tmp", f"{args.out}.rank{max(args.rank, 0)}.pt")
    if args.distributed:
        dist.destroy_process_group()  # test: a clean end of the process group


def log_step(args, state):  # test: the step log, then the step counter (read at the next minibatch's start)
    if args.step_log:
        with open(f"{args.step_log}.rank{max(args.rank, 0)}", "a") as f:
            f.write(f"{jitckpt.wire.contract.attempt()} {state['step']}\n")
    state["step"] += 1


def train(train_loader, model, criterion, optimizer, epoch, args, state):  # test: state

    use_accel = False  # CPU:

    batch_time = AverageMeter('Time', use_accel, ':6.3f', Summary.NONE)
    data_time = AverageMeter('Data', use_accel, ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', use_accel, ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', use_accel, ':6.2f', Summary.NONE)
    top5 = AverageMeter('Acc@5', use_accel, ':6.2f', Summary.NONE)
    progress = ProgressMeter(
        len(train_loader),
        [batch_time, data_time, losses, top1, top5],
        prefix="Epoch: [{}]".format(epoch))

    # switch to train mode
    model.train()

    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        # measure data loading time
        data_time.update(time.time() - end)

        # compute output
        output = model(images)
        loss = criterion(output, target)

        # measure accuracy and record loss
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log_step(args, state)  # test:

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args):

    use_accel = False  # CPU:

    def run_validate(loader, base_progress=0):
        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i
                # CPU: no move to an accelerator

                # compute output
                output = model(images)
                loss = criterion(output, target)

                # measure accuracy and record loss
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0], images.size(0))
                top5.update(acc5[0], images.size(0))

                # measure elapsed time
                batch_time.update(time.time() - end)
                end = time.time()

                if i % args.print_freq == 0:
                    progress.display(i + 1)

    batch_time = AverageMeter('Time', use_accel, ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', use_accel, ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', use_accel, ':6.2f', Summary.AVERAGE)
    top5 = AverageMeter('Acc@5', use_accel, ':6.2f', Summary.AVERAGE)
    progress = ProgressMeter(
        len(val_loader) + (args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset))),
        [batch_time, losses, top1, top5],
        prefix='Test: ')

    # switch to evaluate mode
    model.eval()

    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
        top5.all_reduce()

    if args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset)):
        aux_val_dataset = Subset(val_loader.dataset,
                                 range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        aux_val_loader = torch.utils.data.DataLoader(
            aux_val_dataset, batch_size=args.batch_size, shuffle=False,
            num_workers=args.workers, pin_memory=False)  # CPU: pin_memory was True
        run_validate(aux_val_loader, len(val_loader))

    progress.display_summary()

    return top1.avg


def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, 'model_best.pth.tar')


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter:
    """Computes and stores the average and current value"""
    def __init__(self, name, use_accel, fmt=':f', summary_type=Summary.AVERAGE):
        self.name = name
        self.use_accel = use_accel
        self.fmt = fmt
        self.summary_type = summary_type
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):
        device = torch.device("cpu")  # CPU:
        total = torch.tensor([self.sum, self.count], dtype=torch.float32, device=device)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)

    def summary(self):
        fmtstr = ''
        if self.summary_type is Summary.NONE:
            fmtstr = ''
        elif self.summary_type is Summary.AVERAGE:
            fmtstr = '{name} {avg:.3f}'
        elif self.summary_type is Summary.SUM:
            fmtstr = '{name} {sum:.3f}'
        elif self.summary_type is Summary.COUNT:
            fmtstr = '{name} {count:.3f}'
        else:
            raise ValueError('invalid summary type %r' % self.summary_type)

        return fmtstr.format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print('\t'.join(entries))

    def display_summary(self):
        entries = [" *"]
        entries += [meter.summary() for meter in self.meters]
        print(' '.join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = '{:' + str(num_digits) + 'd}'
        return '[' + fmt + '/' + fmt.format(num_batches) + ']'


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


if __name__ == '__main__':
    main()
